"""``specdec.generate``: a batch of prompts decoded to the end, as a thin driver over the engine.

Legend: B prompts (requests), L cache slots per request.

Each prompt becomes one request of a :class:`specdec.engine.Engine` built for this call (``B`` cache
rows, the context the longest prompt needs); the engine is stepped until every request has finished,
and the requests' tokens, finish reasons and the call's :class:`~specdec.metrics.SpecMetrics` come
back as a :class:`GenerationOutput`. There is one decode path in the project: the engine's
(:mod:`specdec.engine.engine`). Every token follows the target's distribution exactly
(Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318); greedy output equals
plain greedy decoding, and a row's tokens depend on its prompt, settings, seed and drafter only, never
on the other prompts of the call (``tests/test_generate_engine.py``). Thousands of prompts in one call
(the Monte-Carlo tests) cost little Python per row: the engine drafts, verifies and rolls back rows in
groups (:mod:`specdec.engine.units`).

Seeds: row 0 takes ``seed`` itself (so ``generate(target, [p], seed=s)`` emits what
``engine.add_request(p, seed=s)`` does), row b > 0 a seed mixed from ``(seed, b)``; with a
``generator``, each row's seed is drawn from it; with neither, at random. One generation per target at
a time (:mod:`specdec.locks`).
"""

from __future__ import annotations

import functools
import gc
import numbers
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdec.drafters.request_slots import mix_seed
from specdec.engine.cost_model import COST_CONTEXT
from specdec.engine.depth import DepthPolicy, FixedDepth, make_depth_policy
from specdec.engine.engine import Engine
from specdec.engine.request import RequestMetrics
from specdec.locks import exclusive
from specdec.logits import SAMPLING_CONTROLS
from specdec.metrics import MetricsRecorder, SpecMetrics
from specdec.protocols import Drafter, Target
from specdec.seeds import check_seed
from specdec.verify.contract import VerifyRule

__all__ = ["ARRIVALS", "GenerationOutput", "drive", "generate", "model_len_for"]


@dataclass
class GenerationOutput:
    """Result of :func:`generate`.

    ``token_ids``: generated ids only, per row, cut at the stop condition (an EOS token or the token
    that completed a stop string is included). ``finish_reasons``: ``"eos"``, ``"stop_string"``,
    ``"grammar"`` (its grammar allows no further token) or ``"length"`` per row. ``seeds``: the seed
    each row's randomness was keyed by.
    """

    prompt_token_ids: list[list[int]]
    token_ids: list[list[int]]
    finish_reasons: list[str]
    metrics: SpecMetrics
    seeds: list[int] | None = None
    requests: list[RequestMetrics | None] | None = None
    """Each row's own measurements (TPOT, α, τ, depth changes), as its request finished."""
    engine_stats: dict[str, float] | None = None
    """The engine's :attr:`~specdec.Engine.stats` spent on this call (seconds, steps)."""


# --- boundary checks ------------------------------------------------------------------------------


def _normalise_prompts(prompt_ids: Any, vocab_size: int) -> list[list[int]]:
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.ndim != 2 or prompt_ids.is_floating_point() or prompt_ids.dtype == torch.bool:
            raise ValueError(
                f"prompt_ids tensor must be an integer tensor of shape [B, T], got dtype {prompt_ids.dtype} "
                f"shape {tuple(prompt_ids.shape)}"
            )
        prompts = prompt_ids.tolist()
    elif isinstance(prompt_ids, Sequence) and not isinstance(prompt_ids, (str, bytes)):
        prompts = []
        for b, row in enumerate(prompt_ids):
            if hasattr(row, "tolist") and not isinstance(row, (list, tuple)):  # a tensor or numpy array
                row = row.tolist()
            if not isinstance(row, Sequence) or isinstance(row, (str, bytes)):
                raise ValueError(
                    f"prompt_ids must be a sequence of token-id sequences (one per row); row {b} is "
                    f"{type(row).__name__}"
                )
            # bool is an Integral: keep it as is, so the check below refuses it
            prompts.append(
                [int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) else t for t in row]
            )
    else:
        raise ValueError(
            f"prompt_ids must be a [B, T] tensor or a list of lists of ints, got {type(prompt_ids)}"
        )
    if not prompts:
        raise ValueError("prompt_ids must hold at least one prompt")
    for b, row in enumerate(prompts):
        if not row:
            raise ValueError(f"prompt_ids row {b} is empty; every prompt needs at least one token")
        for t in row:
            if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab_size:
                raise ValueError(
                    f"prompt_ids row {b} holds {t!r}; token ids must be ints in [0, {vocab_size})"
                )
    return prompts


def _context_limit(target: Target) -> int | None:
    limit = getattr(target, "max_context_length", None)
    return int(limit) if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def _row_seeds(B: int, seed: int | None, generator: torch.Generator | None) -> list[int | None]:
    if seed is not None:
        return [seed if b == 0 else mix_seed(seed, b, 3) for b in range(B)]
    if generator is not None:
        draws = torch.randint(0, 2**32, (B, 2), generator=generator, device=generator.device).tolist()
        return [(hi << 32) | lo for hi, lo in draws]
    return [None] * B


def generate(
    target: Target,
    prompt_ids: Sequence[Sequence[int]] | torch.Tensor,
    *,
    drafter: Drafter | str = "none",
    drafter_options: Mapping[str, Any] | None = None,
    max_new_tokens: int = 128,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    gamma: int | str | DepthPolicy = 4,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    eos_token_ids: Sequence[int] | None = None,
    ignore_eos: bool = False,
    stop_strings: Sequence[str] | None = None,
    tokenizer: Any = None,
    on_commit: Callable[[int, list[int]], None] | None = None,
    verify: str | VerifyRule = "exact",
    verify_options: Mapping[str, Any] | None = None,
    gamma_options: Mapping[str, Any] | None = None,
    **controls: Any,
) -> GenerationOutput:
    """Generate up to ``max_new_tokens`` tokens per prompt with speculative decoding.

    The output distribution is exactly the target's (processed by the logits processors and by
    ``temperature``, ``top_k``, ``top_p``, ``min_p``) for any drafter; greedy (``temperature=0``) output
    equals plain greedy decoding with the same processors.
    Every proposal and every block of logits is checked (:mod:`specdec.checks`): a drafter or
    target that hands over NaN, negative or unnormalised probabilities, or ids out of range, stops
    the run with a ``ValueError`` naming the prompt and the step (in the engine and the server such a
    request fails alone: :mod:`specdec.engine.faults`). One generation per target at a time: a concurrent
    call on the same target from another thread waits for this one (:mod:`specdec.locks`). The
    prompts run as requests of one :class:`specdec.engine.Engine` (see the module doc).

    Args:
        target: a :class:`specdec.protocols.Target` with the slot API (``rows_B``).
        prompt_ids: B prompts (lists of ids, lengths may differ) or a ``[B, T]`` tensor.
        drafter: a :class:`specdec.protocols.Drafter` or :class:`~specdec.protocols.SlotDrafter`, or a
            name in :data:`specdec.registry.DRAFTERS` built with ``drafter_options``: the engine's one
            slot drafter (:func:`specdec.drafters.engine_drafter.make_slot_drafter`: a slot drafter
            object must have a slot per prompt; a one-request object serves the first prompt and the
            others get copies, one with ``batched_rows`` serves every row).
        gamma: the draft depth: an int (every step drafts that many), a policy name in
            :data:`specdec.engine.depth.DEPTH_POLICIES` (``fixed``, ``batch-table``, ``goodput``,
            ``auto``) built with ``gamma_options``, or a :class:`specdec.engine.depth.DepthPolicy`.
        seed: an int in [0, 2**64) (numpy ints too): same seed, same tokens; or pass ``generator``
            (each row's seed is drawn from it).
        eos_token_ids: default ``target.eos_token_ids``; ``ignore_eos=True`` disables EOS.
        stop_strings: stop a row once its generated text contains one of them (needs a tokenizer:
            ``tokenizer`` or ``target.tokenizer``).
        on_commit: streaming callback ``(row, newly committed ids)``, called after each engine step.
        verify: the verification rule, a name in :data:`specdec.verify.registry.VERIFY_RULES` built with
            ``verify_options``, or a :class:`specdec.verify.contract.VerifyRule`. Default ``"exact"``
            (rejection sampling, position-keyed); ``"gumbel"`` is drafter-invariant; ``"lenient"``
            (:mod:`specdec.verify.lenient`) is lossy.
        controls: every row's sampling controls, the keywords of :meth:`specdec.Engine.add_request`
            named in :data:`specdec.logits.SAMPLING_CONTROLS` (``min_p``, the penalties,
            ``logit_bias``, ``min_tokens``, ``logits_processors``, ``grammar``: :mod:`specdec.logits`;
            a grammar needs a tokenizer); another keyword is a ``ValueError`` naming it.

    Returns:
        :class:`GenerationOutput` with per-row generated ids, finish reasons, :class:`SpecMetrics`
        and the seed of each row.

    Raises ``ValueError`` when the prompt plus ``max_new_tokens`` (plus γ + 1 verify slots) exceeds
    the target's ``max_context_length``.
    """
    if not isinstance(target, Target):
        raise ValueError(
            f"target must implement specdec.protocols.Target (reset/forward/rollback), got {type(target)}"
        )
    unknown = sorted(set(controls) - set(SAMPLING_CONTROLS))
    if unknown:
        raise ValueError(
            f"generate() got unknown keyword {unknown[0]!r}; its sampling controls are "
            f"{', '.join(SAMPLING_CONTROLS)}"
        )
    prompts = _normalise_prompts(prompt_ids, int(target.vocab_size))
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    policy = make_depth_policy(gamma, gamma_options)
    limit = _context_limit(target)
    longest = max(len(p) for p in prompts)
    needed = longest + max_new_tokens + policy.gamma + 1
    if limit is not None and needed > limit:
        raise ValueError(
            f"the longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) + gamma + 1 "
            f"({policy.gamma + 1}) = {needed} tokens exceeds the target's context length "
            f"max_context_length={limit}"
        )
    if seed is not None and generator is not None:
        raise ValueError("pass either seed or generator, not both")
    if seed is not None:
        seed = check_seed(seed)
    if stop_strings is not None and (
        isinstance(stop_strings, str) or not all(isinstance(s, str) and s for s in stop_strings)
    ):
        raise ValueError(f"stop_strings must be a list of non-empty strings, got {stop_strings!r}")
    B = len(prompts)
    chunk = 32
    budget = B * (policy.gamma + 1) + sum(-(-len(p) // chunk) * chunk for p in prompts)
    model_len, measure_cost = model_len_for(target, needed, policy)
    shared_drafter = None if isinstance(drafter, str) else drafter
    with exclusive(target, shared_drafter):
        engine = Engine(
            target,
            drafter=drafter,
            drafter_options=drafter_options,
            gamma=policy,
            max_num_seqs=B,
            max_num_batched_tokens=max(budget, chunk + B * (policy.gamma + 1)),
            verify=verify,
            verify_options=verify_options,
            max_model_len=model_len,
            prefill_chunk=chunk,
            measure_cost=measure_cost,
            tokenizer=tokenizer,
        )
        return drive(engine, prompts, {
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "stop_strings": list(stop_strings) if stop_strings else None,
            "eos_token_ids": eos_token_ids,
            "ignore_eos": ignore_eos,
            **controls,
        }, seeds=_row_seeds(B, seed, generator), on_commit=on_commit)  # fmt: skip


def _without_cyclic_gc(fn: Callable[..., GenerationOutput]) -> Callable[..., GenerationOutput]:
    """Run ``fn`` with Python's cyclic garbage collector paused: thousands of live requests (a
    Monte-Carlo call holds tens of thousands) make its full passes a quarter of the time, and the
    engine's objects are freed by reference counting anyway."""

    @functools.wraps(fn)
    def paused(*args: Any, **kwargs: Any) -> GenerationOutput:
        collecting = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if collecting:
                gc.enable()

    return paused


def model_len_for(target: Target, needed: int, policy: DepthPolicy) -> tuple[int, bool]:
    """An engine's cache slots per row for requests that need ``needed``, and whether it measures the
    verify-cost grid: an adaptive policy reads the grid, timed with a 64-token context
    (:data:`~specdec.engine.cost_model.COST_CONTEXT`), so the cache makes room where the target allows."""
    if isinstance(policy, FixedDepth):
        return needed, False
    model_len = max(needed, min(_context_limit(target) or COST_CONTEXT, COST_CONTEXT))
    return model_len, model_len >= COST_CONTEXT


ARRIVALS = ("together", "staggered")
"""How :func:`drive` admits requests at a concurrency c: ``together``, c at once and the next c when all
have finished; ``staggered``, a closed loop that keeps c in flight (one joins as soon as one leaves)."""


@_without_cyclic_gc
def drive(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    params: Mapping[str, Any],
    *,
    seeds: Sequence[int | None] | None = None,
    concurrency: int | None = None,
    arrival: str = "together",
    on_commit: Callable[[int, list[int]], None] | None = None,
) -> GenerationOutput:
    """Run ``prompts`` through ``engine`` to the end: the project's one in-process driver
    (:func:`generate`, ``specdec bench`` with and without ``--concurrency``, the experiments).

    Every prompt becomes a request with ``params`` (:meth:`Engine.add_request`'s keywords) and its seed
    in ``seeds``; at most ``concurrency`` of them (default: all) are in the engine at once, admitted as
    ``arrival`` says (:data:`ARRIVALS`). The engine may be reused: the metrics are this call's (the
    engine's ``stats`` differenced around it). A request that fails raises ``ValueError`` naming its
    prompt, after the others are aborted (a library call's one run fails).
    """
    B = len(prompts)
    if arrival not in ARRIVALS:
        raise ValueError(f"arrival must be one of {', '.join(ARRIVALS)}, got {arrival!r}")
    c = B if concurrency is None else concurrency
    if isinstance(c, bool) or not isinstance(c, int) or c < 1:
        raise ValueError(f"concurrency must be an int >= 1, got {concurrency!r}")
    seeds = [None] * B if seeds is None else list(seeds)
    if len(seeds) != B:
        raise ValueError(f"seeds must hold one seed per prompt ({B}), got {len(seeds)}")
    recorder = MetricsRecorder()
    engine.recorder = recorder
    stats0 = dict(engine.stats)
    t_start = time.perf_counter()
    tokens: list[list[int]] = [[] for _ in range(B)]
    reasons = ["length"] * B
    used_seeds: list[int | None] = [None] * B
    requests: list[RequestMetrics | None] = [None] * B
    first_token_s = [t_start] * B
    todo = list(range(B))

    def admit(n: int) -> None:
        n = max(0, n)
        for b in todo[:n]:
            rid = engine.add_request(prompts[b], request_id=str(b), seed=seeds[b], **params)
            used_seeds[b] = engine.requests[rid].params.seed
        del todo[:n]

    t_prev = t_start
    while todo or engine.has_unfinished():
        if arrival == "together" and not engine.has_unfinished():
            admit(c)
        elif arrival == "staggered":
            admit(c - engine.num_running - engine.num_waiting)
        outputs = engine.step()
        t_now = time.perf_counter()
        for out in outputs:
            b = int(out.request_id)  # each request's id is its row's index
            new = out.new_token_ids
            if new and not tokens[b]:  # the prefill's token: counted, not a decode latency
                first_token_s[b] = out.metrics.first_token_s or t_now
                recorder.num_generated += 1
                recorder.record_commit(t_now - t_prev, len(new) - 1)
            else:
                recorder.record_commit(t_now - t_prev, len(new))
            tokens[b].extend(new)
            if out.finish_reason == "error":
                for rid in list(engine.requests):
                    engine.abort(rid)
                raise ValueError(f"prompt_ids[{b}]: {out.error}")
            if out.finished:
                reasons[b] = out.finish_reason or "length"
                requests[b] = out.metrics
            if new and on_commit is not None:
                on_commit(b, list(new))
        t_prev = t_now
    stats = {k: engine.stats[k] - stats0[k] for k in stats0}
    recorder.record_prefill(stats["prefill_s"], stats["begin_s"], max(first_token_s) - t_start, 0)
    return GenerationOutput(
        prompt_token_ids=[list(p) for p in prompts],
        token_ids=tokens,
        finish_reasons=reasons,
        metrics=recorder.finish(time.perf_counter() - t_start),
        seeds=used_seeds,
        requests=requests,
        engine_stats=stats,
    )
