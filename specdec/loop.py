"""The speculative decode loop: prefill, then per step propose → verify in one target call → commit.

Legend: B batch, L sequence capacity, T target block length, K draft length (γ), V vocabulary.

Leviathan et al. 2023 (arXiv 2211.17192) and Chen et al. 2023 (arXiv 2302.01318). Every token
the loop commits is drawn by :func:`specdec.verify.rejection_sample` from the target's distribution
processed by :func:`specdec.sampling.logits_to_probs` (the first one, after the prefill, by
:func:`specdec.sampling.sample_from_probs` from the same distribution), so the output follows the
target's distribution exactly whatever the drafter proposes; with γ = 0 or an empty proposal a step
is a plain decode step (one bonus token).

Every step takes one path, chain or tree alike: propose → check the proposal
(:mod:`specdec.checks`) → one target forward over the proposal's block (:mod:`specdec.blocks`) →
check the logits → the verification rule → commit → settle the cache (compaction and rollback, in
the block) → the drafter observes → one :class:`~specdec.metrics.StepStats` to the metrics and the
γ policy.

Cache invariant between steps (see :mod:`specdec.protocols`): the target's cache holds
``lengths_B - 1`` tokens per row. Rows advance by different amounts (ragged acceptance); a finished
row stays in the batch with its length frozen, its output ignored. One generation per target at a
time (:mod:`specdec.locks`).
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdec.blocks import Verdict, make_block
from specdec.checks import check_logits, check_proposal
from specdec.locks import exclusive
from specdec.metrics import MetricsRecorder, SpecMetrics, StepStats
from specdec.policies import GammaPolicy, as_policy
from specdec.protocols import DecodeState, Drafter, Target
from specdec.registry import create_drafter
from specdec.sampling import SamplingParams, logits_to_probs, sample_from_probs
from specdec.seeds import check_seed
from specdec.stop_strings import StopStrings
from specdec.verify_rules import VerifyRule, make_verify_rule

__all__ = ["GenerationOutput", "generate"]


@dataclass
class GenerationOutput:
    """Result of :func:`generate`.

    ``token_ids``: generated ids only, per row, cut at the stop condition (an EOS token or the token
    that completed a stop string is included). ``finish_reasons``: ``"eos"``, ``"stop_string"`` or
    ``"length"`` per row.
    """

    prompt_token_ids: list[list[int]]
    token_ids: list[list[int]]
    finish_reasons: list[str]
    metrics: SpecMetrics


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


def _as_drafter(drafter: Drafter | str, target: Target, options: Mapping[str, Any] | None) -> Drafter:
    if isinstance(drafter, str):
        drafter = create_drafter(drafter, target, **dict(options or {}))
    elif options:
        raise ValueError("drafter_options only apply when drafter is given by name")
    if not isinstance(drafter, Drafter):
        raise ValueError(
            f"drafter must be a registered name or an object with begin/propose/observe, got {type(drafter)}"
        )
    return drafter


def _clock(device: torch.device) -> Callable[[], float]:
    if device.type == "cuda":

        def now() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()

        return now
    return time.perf_counter


# --- the loop ---------------------------------------------------------------------------------------


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
    gamma: int | GammaPolicy = 4,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    eos_token_ids: Sequence[int] | None = None,
    ignore_eos: bool = False,
    stop_strings: Sequence[str] | None = None,
    tokenizer: Any = None,
    on_commit: Callable[[int, list[int]], None] | None = None,
    verify: str | VerifyRule = "exact",
    verify_options: Mapping[str, Any] | None = None,
) -> GenerationOutput:
    """Generate up to ``max_new_tokens`` tokens per prompt with speculative decoding.

    The output distribution is exactly the target's (processed by ``temperature``, ``top_k``,
    ``top_p``) for any drafter; greedy (``temperature=0``) output equals plain greedy decoding.
    Every proposal and every block of logits is checked (:mod:`specdec.checks`): a drafter or
    target that hands over NaN, negative or unnormalised probabilities, or ids out of range, stops
    the run with a ``ValueError`` naming the step and the row. One generation per target at a time:
    a concurrent call on the same target from another thread waits for this one
    (:mod:`specdec.locks`); several prompts in one call are batched.

    Args:
        target: any :class:`specdec.protocols.Target`.
        prompt_ids: B prompts (lists of ids, lengths may differ) or a ``[B, T]`` tensor.
        drafter: a :class:`specdec.protocols.Drafter`, or a name in :data:`specdec.registry.DRAFTERS`
            built as ``create_drafter(name, target, **drafter_options)``.
        gamma: fixed draft length γ, a policy name (``fixed``, ``heuristic``, ``cost``) or a
            :class:`specdec.policies.GammaPolicy`.
        seed: an int in [0, 2**64) (numpy ints too) seeding a ``torch.Generator`` (same seed, same
            tokens); or pass ``generator``.
        eos_token_ids: default ``target.eos_token_ids``; ``ignore_eos=True`` disables EOS.
        stop_strings: stop a row once its generated text contains one of them (needs a tokenizer:
            ``tokenizer`` or ``target.tokenizer``).
        on_commit: streaming callback ``(row, newly committed ids)``, called as tokens are committed.
        verify: the verification rule, a name in :data:`specdec.verify_rules.VERIFY_RULES` built with
            ``verify_options``, or a :class:`specdec.verify_rules.VerifyRule`. Default ``"exact"``
            (rejection sampling); ``"lenient"`` (:mod:`specdec.verify_lossy`) is lossy.

    Returns:
        :class:`GenerationOutput` with per-row generated ids, finish reasons and :class:`SpecMetrics`.

    Raises ``ValueError`` when the prompt plus ``max_new_tokens`` (plus γ + 1 verify slots) exceeds
    the target's ``max_context_length``.
    """
    if not isinstance(target, Target):
        raise ValueError(
            f"target must implement specdec.protocols.Target (reset/forward/rollback), got {type(target)}"
        )
    prompts = _normalise_prompts(prompt_ids, int(target.vocab_size))
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    policy = as_policy(gamma)
    limit = _context_limit(target)
    longest = max(len(p) for p in prompts)
    needed = longest + max_new_tokens + policy.max_gamma + 1
    if limit is not None and needed > limit:
        raise ValueError(
            f"the longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) + gamma + 1 "
            f"({policy.max_gamma + 1}) = {needed} tokens exceeds the target's context length "
            f"max_context_length={limit}"
        )
    if seed is not None and generator is not None:
        raise ValueError("pass either seed or generator, not both")
    if seed is not None:
        seed = check_seed(seed)
    eos = (
        frozenset()
        if ignore_eos
        else frozenset(int(t) for t in (target.eos_token_ids if eos_token_ids is None else eos_token_ids))
    )
    stops = None
    if stop_strings:
        if isinstance(stop_strings, str) or not all(isinstance(s, str) and s for s in stop_strings):
            raise ValueError(f"stop_strings must be a list of non-empty strings, got {stop_strings!r}")
        tokenizer = tokenizer if tokenizer is not None else getattr(target, "tokenizer", None)
        if tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: pass tokenizer= (the target has none)")
        stops = StopStrings(tokenizer, stop_strings)
    shared_drafter = None if isinstance(drafter, str) else drafter
    verify_rule = make_verify_rule(verify, verify_options)
    device = torch.device(getattr(target, "device", "cpu"))
    with exclusive(target, shared_drafter):
        drafter = _as_drafter(drafter, target, drafter_options)
        if seed is not None:
            generator = torch.Generator(device=device).manual_seed(seed)
        decoder = _Decoder(
            target, drafter, policy, sampling, generator, eos, stops, on_commit, device, verify_rule
        )
        return decoder.run(prompts, max_new_tokens)


class _Decoder:
    """One generation's mutable state; :meth:`run` is the loop, each phase one method."""

    def __init__(
        self,
        target: Target,
        drafter: Drafter,
        policy: GammaPolicy,
        sampling: SamplingParams,
        generator: torch.Generator | None,
        eos: frozenset[int],
        stops: StopStrings | None,
        on_commit: Callable[[int, list[int]], None] | None,
        device: torch.device,
        verify_rule: VerifyRule,
    ) -> None:
        self.target, self.drafter, self.policy, self.sampling = target, drafter, policy, sampling
        self.generator, self.eos, self.stops, self.on_commit = generator, eos, stops, on_commit
        self.device, self.verify_rule = device, verify_rule
        self.drafter_name = type(drafter).__name__
        self.now = _clock(device)
        self.metrics = MetricsRecorder()
        self.step_index = 0

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], max_new_tokens: int) -> GenerationOutput:
        B = len(prompts)
        self.max_new_tokens = max_new_tokens
        self.generated: list[list[int]] = [[] for _ in range(B)]
        self.finish_reasons = ["length"] * B
        self.finished = [False] * B
        t_start = self.now()
        state = self._prefill(prompts, t_start)
        while not all(self.finished):
            self._step(state)
        return GenerationOutput(
            prompt_token_ids=[list(p) for p in prompts],
            token_ids=self.generated,
            finish_reasons=self.finish_reasons,
            metrics=self.metrics.finish(self.now() - t_start),
        )

    # --- phases -----------------------------------------------------------------------------------
    def _prefill(self, prompts: list[list[int]], t_start: float) -> DecodeState:
        """The whole prompt in one forward (logits only at each row's last prompt token), the first
        token sampled from it, then the drafter's ``begin``."""
        B, device = len(prompts), self.device
        prompt_lens = [len(p) for p in prompts]
        max_prompt = max(prompt_lens)
        # Capacity: a block of γ+1 starts at lengths-1 ≤ prompt + max_new_tokens - 1.
        capacity = max_prompt + self.max_new_tokens + self.policy.max_gamma + 1
        tokens_BL = torch.zeros((B, capacity), dtype=torch.long, device=device)
        for b, p in enumerate(prompts):
            tokens_BL[b, : len(p)] = torch.tensor(p, dtype=torch.long)
        prompt_lengths_B = torch.tensor(prompt_lens, dtype=torch.long, device=device)
        self.target.reset(B, capacity)
        prefill = self.target.forward(
            tokens_BL[:, :max_prompt],
            torch.zeros(B, dtype=torch.long, device=device),
            logits_index_BN=(prompt_lengths_B - 1).unsqueeze(1),
        )
        check_logits(prefill.logits_BTV, step="prefill", source="the target")
        t_prefill = self.now()
        s = self.sampling
        first_B = sample_from_probs(
            logits_to_probs(prefill.logits_BTV[:, -1], s.temperature, s.top_k, s.top_p), self.generator
        )
        tokens_BL[torch.arange(B, device=device), prompt_lengths_B] = first_B
        self.target.rollback(prompt_lengths_B)
        for b, t in enumerate(first_B.tolist()):
            self._commit_row(b, [t])
        state = DecodeState(
            tokens_BL=tokens_BL,
            prompt_lengths_B=prompt_lengths_B,
            lengths_B=prompt_lengths_B + 1,
            finished_B=torch.tensor(self.finished, device=device),
            sampling=s,
        )
        t_first = self.now()
        self.drafter.begin(state, prefill)
        self.t_prev = self.now()
        self.metrics.record_prefill(t_prefill - t_start, self.t_prev - t_first, t_first - t_start, B)
        return state

    def _step(self, state: DecodeState) -> None:
        """One speculative step: propose, one target call, verify, commit, settle, observe, record."""
        self.step_index += 1
        active = [b for b in range(state.batch_size) if not self.finished[b]]
        room = max(self.max_new_tokens - len(self.generated[b]) for b in active)
        gamma = max(0, min(int(self.policy.next_gamma(state)), self.policy.max_gamma, room - 1))
        t0 = self.now()
        proposal = self.drafter.propose(state, gamma, self.generator)
        t1 = self.now()
        check_proposal(
            proposal,
            batch_size=state.batch_size,
            gamma=gamma,
            vocab_size=self.target.vocab_size,
            step=self.step_index,
            source=self.drafter_name,
        )
        block = make_block(proposal, self.target)
        start_B = state.lengths_B - 1
        t_checked = self.now()
        out = self.target.forward(
            block.tokens_BT(state.last_tokens_B()), start_B, **block.forward_kwargs(self.device)
        )
        t_fwd = self.now()
        check_logits(out.logits_BTV, step=self.step_index, source="the target")
        t_logits = self.now()
        verdict = block.verify(self.verify_rule, out.logits_BTV, self.sampling, self.generator)
        num_new = self._commit(state, verdict, active)
        observed = block.settle(self.target, out, verdict, start_B, state.lengths_B)
        t3 = self.now()
        self.drafter.observe(state, verdict.num_accepted_B, observed)
        t4 = self.now()
        accepted = verdict.num_accepted_B.tolist()
        self._record(
            StepStats(
                gamma=gamma,
                num_drafted=block.num_drafted,
                depth=block.depth,
                num_accepted=[accepted[b] for b in active],
                draft_time_s=(t1 - t0) + (t4 - t3),
                target_time_s=t_fwd - t_checked,
                verify_time_s=t3 - t1,  # checks, forward, verification and commit: a block's price
                check_time_s=(t_checked - t1) + (t_logits - t_fwd),
            ),
            [num_new[b] for b in active],
            t4,
        )

    def _commit(self, state: DecodeState, verdict: Verdict, active: list[int]) -> list[int]:
        """Write the committed tokens, cut each row at its stop conditions; returns new counts per row."""
        tokens_BA = verdict.tokens_BA.to(self.device)
        A = tokens_BA.shape[1]
        rows_B1 = torch.arange(state.batch_size, device=self.device).unsqueeze(1)
        # Slots past a row's length are undefined, so the whole block is written at once (padding
        # as token 0: a drafter may feed undefined slots to a model, never -1).
        state.tokens_BL[rows_B1, state.lengths_B.unsqueeze(1) + torch.arange(A, device=self.device)] = (
            tokens_BA.clamp(min=0)
        )
        tokens_list, accepted_list = tokens_BA.tolist(), verdict.num_accepted_B.tolist()
        num_new = [0] * state.batch_size
        for b in active:
            num_new[b] = len(self._commit_row(b, tokens_list[b][: accepted_list[b] + 1]))
        state.lengths_B = state.lengths_B + torch.tensor(num_new, device=self.device)
        state.finished_B = torch.tensor(self.finished, device=self.device)
        return num_new

    def _record(self, stats: StepStats, num_new_active: list[int], t_end: float) -> None:
        """One step's stats to the metrics and the γ policy, and per-token latencies."""
        step_wall = t_end - self.t_prev
        self.t_prev = t_end
        for n in num_new_active:
            self.metrics.record_commit(step_wall, n)
        self.metrics.record_step(stats)
        self.policy.update(stats)

    def _commit_row(self, b: int, new: list[int]) -> list[int]:
        """Cut a row's new tokens at its stop conditions, record them, return what was kept."""
        gen = self.generated[b]
        new = new[: self.max_new_tokens - len(gen)]
        reason = None
        for i, t in enumerate(new):
            if t in self.eos:
                new, reason = new[: i + 1], "eos"
                break
        if self.stops is not None and new:
            num_old = len(gen)
            end = self.stops.first_stop(gen + new, num_old)
            if end is not None:
                new, reason = new[: end - num_old], "stop_string"
        gen.extend(new)
        if reason is None and len(gen) >= self.max_new_tokens:
            reason = "length"
        if reason is not None:
            self.finish_reasons[b] = reason
            self.finished[b] = True
        if new and self.on_commit is not None:
            self.on_commit(b, list(new))
        return new
