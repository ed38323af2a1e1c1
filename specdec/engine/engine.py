"""The continuous-batching engine: requests join and leave at every step.

Legend: B rows decoding in a step, K a row's draft depth, T = K + 1 its verify block.

Each :meth:`Engine.step` is three calls:

1. the **scheduler** (:mod:`specdec.engine.scheduler`) admits waiting requests into free cache rows,
   gives every decoding request its draft depth and spends the token budget left on prompt chunks:
   a :class:`~specdec.engine.plan.StepPlan`, per request the tokens to compute and the depth;
2. the **runner** (:mod:`specdec.engine.runner`) carries the plan out: the engine's one slot drafter
   proposes for the drafting rows, one target forward verifies every decoding row (each at its own
   cache row and position), the rule decides, rows commit and roll back, the drafter observes; then
   the prompt chunks run, and a prompt's last position goes through the rule at depth 0;
3. the scheduler **updates** from the runner's :class:`~specdec.engine.plan.StepReport` (drafting
   cost; finished requests free their rows).

A finished or aborted request leaves at once and its row is reused; finished rows are never
computed again. What a request emits depends on its prompt, settings, seed and drafter only
(never on its neighbours or on timings): greedy rows take the target's argmax whatever their
depth, ``gumbel`` rows reproduce plain keyed decoding whatever their depth, and the depth of a
sampled ``exact`` row depends on its own acceptance only. This needs the target's forward to give a
row the same logits whatever the other rows of the block are (batch invariance).
"""

from __future__ import annotations

import inspect
import itertools
import secrets
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from specdec.drafters.engine_drafter import drafter_name, make_slot_drafter
from specdec.engine.controls import RequestControls
from specdec.engine.cost_cache import verify_cost_for
from specdec.engine.cost_model import OnlineVerifyCost
from specdec.engine.depth import DepthPolicy, FixedDepth, make_depth_policy
from specdec.engine.draft_cost import DraftCost, measure_draft_cost
from specdec.engine.ownership import claim_target, release_target
from specdec.engine.request import (
    Request,
    RequestOutput,
    check_prompt,
    make_params,
    positive_int,
)
from specdec.engine.runner import Runner
from specdec.engine.scheduler import Scheduler
from specdec.logits import LogitsProcessor
from specdec.metrics import MetricsRecorder
from specdec.protocols import Drafter, SlotDrafter, Target, TreeTarget
from specdec.stop_strings import StopStrings
from specdec.verify.contract import VerifyRule
from specdec.verify.registry import make_verify_rule

__all__ = ["Engine", "scheduler_seconds"]


def scheduler_seconds(stats: Mapping[str, float]) -> float:
    """The engine's own time in :attr:`Engine.stats` (or a difference of two snapshots): a step's
    time outside the target's forwards, the drafters and the verification rule (admission, the
    depth controller, block assembly, commit, stop strings, rollback, bookkeeping)."""
    return stats["total_s"] - stats["forward_s"] - stats["draft_s"] - stats["rule_s"]


class Engine:
    """Continuous batching with speculative decoding over one target (see the module doc).

    Args:
        target: a :class:`specdec.protocols.Target` whose ``forward`` / ``rollback`` take ``rows_B``
            (the native ``llama`` target and the ``hf`` target do).
        drafter: a registered drafter name, built with ``drafter_options``, or a drafter object: the
            engine runs one :class:`~specdec.protocols.SlotDrafter` for every request
            (:func:`specdec.drafters.engine_drafter.make_slot_drafter`: a slot drafter directly, a
            drafter written for one request through one adapter). ``default``: the shipped EAGLE head
            with prompt lookup where the target has one, else prompt lookup.
        gamma: ``auto`` (the default), a depth policy name (``fixed``, ``batch-table``, ``goodput``)
            built with ``gamma_options``, an int (every row drafts that many), or a ``DepthPolicy``.
        max_num_seqs: requests decoding at once (cache rows).
        max_num_batched_tokens: the token budget of a step (decode blocks plus prefill chunks).
        verify: ``exact`` (rejection sampling, position-keyed), ``gumbel`` (drafter-invariant), or
            another rule of :data:`specdec.verify.registry.VERIFY_RULES` built with ``verify_options``, or
            a :class:`specdec.verify.contract.VerifyRule` object. A rule that declares
            ``drafter_invariant`` lets sampled rows take their depths from load and timings.
        max_model_len: cache slots per request (prompt + new tokens + γ + 1 must fit); default
            ``min(target.max_context_length, 2048)``.
        prefill_chunk: tokens per prefill forward (fixed chunk boundaries).
        measure_cost: time the verify-cost grid (policies that read it; once per target and row
            count, or kept per machine: :func:`specdec.engine.cost_cache.verify_cost_for`); False
            uses none.
        tokenizer: for stop strings and grammars (default ``target.tokenizer``).

    ``stats`` (seconds, summed over every step): ``total_s`` inside :meth:`step`; ``forward_s`` the
    target's forwards (prefill chunks included, ``prefill_s``); ``draft_s`` the drafter (``propose``,
    ``add`` (``begin_s``) and ``observe``), of which ``owed_s`` is catch-up owed once (a prompt's, or
    the tokens of steps a row did not draft: more than one step's tokens in a ``propose``); ``rule_s``
    the verification rule's calls; ``verify_s`` from a verify forward's end to its rows settled (the
    rule, commit, rollback, observe).
    :func:`scheduler_seconds` is what is left: the engine's own time.
    """

    def __init__(
        self,
        target: Target,
        *,
        drafter: str | Drafter = "default",
        drafter_options: Mapping[str, Any] | None = None,
        gamma: int | str | DepthPolicy = "auto",
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 512,
        verify: str | VerifyRule = "exact",
        verify_options: Mapping[str, Any] | None = None,
        gamma_options: Mapping[str, Any] | None = None,
        max_model_len: int | None = None,
        prefill_chunk: int = 32,
        measure_cost: bool = True,
        tokenizer: Any = None,
    ) -> None:
        if not isinstance(target, Target):
            raise ValueError(f"target must implement specdec.protocols.Target, got {type(target).__name__}")
        if "rows_B" not in inspect.signature(target.forward).parameters:
            raise ValueError(
                f"target {type(target).__name__} has no slot API (forward/rollback over rows_B): the engine "
                "needs it to run requests at their own cache rows"
            )
        self.max_num_seqs = positive_int(max_num_seqs, "max_num_seqs")
        self.budget = positive_int(max_num_batched_tokens, "max_num_batched_tokens")
        self.prefill_chunk = positive_int(prefill_chunk, "prefill_chunk")
        self.policy = make_depth_policy(gamma, gamma_options)
        self.gamma_max = self.policy.gamma
        decode_max = self.max_num_seqs * (self.gamma_max + 1)
        if self.budget < self.prefill_chunk + decode_max:
            raise ValueError(
                f"max_num_batched_tokens={self.budget} must hold one prefill chunk ({self.prefill_chunk}) "
                f"beside every row's deepest chain (max_num_seqs x (gamma + 1) = {decode_max}), "
                f"so at least {self.prefill_chunk + decode_max}"
            )
        limit = getattr(target, "max_context_length", None)
        self.max_model_len = positive_int(
            min(limit or 2048, 2048) if max_model_len is None else max_model_len, "max_model_len"
        )
        if limit is not None and self.max_model_len > limit:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the target's context length {limit}"
            )
        self.target = target
        self.vocab_size = int(target.vocab_size)
        self.rule: VerifyRule = make_verify_rule(verify, verify_options)
        self.tokenizer = tokenizer if tokenizer is not None else getattr(target, "tokenizer", None)
        self.controls = RequestControls(
            self.tokenizer, self.vocab_size, tuple(getattr(target, "eos_token_ids", ()))
        )
        self.requests: dict[str, Request] = {}
        claim_target(self)
        try:  # what follows uses the target's cache: a failure hands it back
            cost: OnlineVerifyCost | None = None
            if measure_cost and not isinstance(self.policy, FixedDepth):
                # the target's grid (shared by its engines), scaled by this engine's own forwards
                cost = OnlineVerifyCost(verify_cost_for(target, max_rows=self.max_num_seqs))
            self.drafter_name = drafter_name(target, drafter)  # ``default`` resolved (once: it may note why)
            self.now = time.perf_counter
            self.drafter: SlotDrafter = make_slot_drafter(
                target, self.drafter_name if isinstance(drafter, str) else drafter, drafter_options,
                num_slots=self.max_num_seqs, clock=lambda: self.now(),
            )  # fmt: skip
            # drafting seconds per step by drafting rows and depth: measured at the start where a cost
            # model is (rows of the verify grid); learned from every drafting step
            draft_cost = DraftCost()
            if cost is not None:
                draft_cost = measure_draft_cost(target, self.drafter, rows=cost.rows)
            self.scheduler = Scheduler(
                max_num_seqs=self.max_num_seqs,
                budget=self.budget,
                prefill_chunk=self.prefill_chunk,
                policy=self.policy,
                cost=cost,
                draft_cost=draft_cost,
                tree_target=isinstance(target, TreeTarget),
                drafter_invariant=bool(getattr(self.rule, "drafter_invariant", False)),
            )
        except BaseException:
            release_target(self)
            raise
        # Every request's tokens (prompt, then committed), one row per cache row.
        self.tokens_SL = torch.zeros((self.max_num_seqs, self.max_model_len), dtype=torch.long)
        self.stats = {
            "steps": 0, "total_s": 0.0, "forward_s": 0.0, "draft_s": 0.0, "verify_s": 0.0,
            "prefill_s": 0.0, "begin_s": 0.0, "rule_s": 0.0, "owed_s": 0.0,
        }  # fmt: skip
        self.runner = Runner(
            target=target,
            rule=self.rule,
            drafter=self.drafter,
            drafter_name=self.drafter_name,
            tokens_SL=self.tokens_SL,
            max_model_len=self.max_model_len,
            prefill_chunk=self.prefill_chunk,
            gamma_max=self.gamma_max,
            stats=self.stats,
            now=lambda: self.now(),
        )
        self._ids = itertools.count()

    # --- public API ---------------------------------------------------------------------------
    def add_request(
        self,
        prompt_ids: Sequence[int],
        *,
        request_id: str | None = None,
        max_new_tokens: int = 128,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop_strings: Sequence[str] | None = None,
        eos_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        speculative: bool = True,
        min_p: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        repetition_penalty: float | None = None,
        logit_bias: Mapping[int, float] | None = None,
        min_tokens: int | None = None,
        logits_processors: Sequence[LogitsProcessor] = (),
        grammar: Any = None,
    ) -> str:
        """Queue a request; returns its id. ``seed`` None draws one at random (the output is then
        fixed by that seed, readable as ``engine.requests[id].params.seed``). ``logprobs``,
        ``prompt_logprobs``: :mod:`specdec.engine.logprobs` (None: not reported). ``speculative=False``:
        the request never drafts (every step a plain one; its ``num_drafted`` stays 0), whatever the
        engine's depth policy; its tokens are what plain decoding with its seed gives.

        ``min_p``, ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``, ``logit_bias``,
        ``min_tokens``: :class:`~specdec.sampling.SamplingParams` (None: off); ``logits_processors``: the
        request's own (:data:`specdec.logits.LogitsProcessor`); ``grammar``: a
        :class:`specdec.logits.GrammarSpec` its output must follow (structured output). They apply at
        every verify position with its own prefix (:mod:`specdec.logits`), so speculation keeps the
        processed distribution exactly."""
        ids = check_prompt(prompt_ids, self.vocab_size)
        params = make_params(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=secrets.randbits(64) if seed is None else seed,
            stop_strings=stop_strings,
            eos_token_ids=eos_token_ids,
            ignore_eos=ignore_eos,
            default_eos=tuple(getattr(self.target, "eos_token_ids", ())),
            vocab_size=self.vocab_size,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            speculative=speculative,
            processors={
                "min_p": min_p,
                "presence_penalty": presence_penalty,
                "frequency_penalty": frequency_penalty,
                "repetition_penalty": repetition_penalty,
                "logit_bias": logit_bias,
                "min_tokens": min_tokens,
            },
        )
        processors = self.controls.processors(ids, params, logits_processors, grammar)
        # A request for one token takes it from its prompt's last position and never decodes, so
        # never drafts: it keeps no slots for draft blocks (echo scoring fills the context).
        reserve = self.gamma_max + 1 if params.max_new_tokens > 1 else 0
        needed = len(ids) + params.max_new_tokens + reserve
        if needed > self.max_model_len:  # the prompt is to blame where it leaves no room for one token
            full = len(ids) + 1 > self.max_model_len
            raise ValueError(
                f"{'prompt_ids' if full else 'max_new_tokens'}: the prompt ({len(ids)} tokens) + "
                f"max_new_tokens ({params.max_new_tokens}) + gamma + 1 ({reserve}) = {needed} "
                f"tokens exceeds max_model_len={self.max_model_len}"
            )
        stops = None
        if params.stop_strings:
            if self.tokenizer is None:
                raise ValueError("stop_strings need a tokenizer: pass tokenizer= (the target has none)")
            stops = StopStrings(self.tokenizer, params.stop_strings)
        if request_id is None:  # req-N, past any id a caller chose that is still here
            request_id = next(i for i in map("req-{}".format, self._ids) if i not in self.requests)
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        request = Request(request_id, ids, params, stops)
        request.processors = processors
        request.metrics.arrival_s = self.now()
        self.requests[request_id] = request
        self.scheduler.waiting.append(request)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now (finish reason ``abort``), free its row, return its final output (the
        abort's only report: :meth:`step` never returns it); None if it is not here."""
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {request_id!r:.80}")
        if (request := self.requests.pop(request_id, None)) is None:
            return None
        request.finish_reason = "abort"
        self.runner.finish(request)  # the drafter drops its slot
        self.scheduler.remove(request)
        return request.output([])

    def reset_target(self) -> None:
        """Prepare the target's cache for this engine again, after another user of the same target
        (``specdec.generate`` or another engine) reset it; only while no request is here. (:meth:`step`
        does it too, where this engine has no request in the cache and the other user is idle.)"""
        if self.has_unfinished():
            raise ValueError("reset_target() needs an idle engine: requests are waiting or running")
        claim_target(self, force=True)

    def has_unfinished(self) -> bool:
        """True while a request waits or runs."""
        return bool(self.scheduler.waiting or self.scheduler.running)

    @property
    def running(self) -> list[Request]:
        """Requests holding a cache row (prefilling or decoding), in admission order."""
        return self.scheduler.running

    @property
    def waiting(self) -> deque[Request]:
        """Requests queued for a cache row, first come first served."""
        return self.scheduler.waiting

    @property
    def free_rows(self) -> list[int]:
        """Cache rows no request holds, in order."""
        return sorted(self.scheduler.free_heap)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def cost(self) -> OnlineVerifyCost | None:
        """The verify cost (the measured grid, scaled by this engine's forwards; None: not measured),
        which the depth policy reads."""
        return self.scheduler.cost

    @property
    def draft_cost(self) -> DraftCost:
        """The drafting cost by drafting rows and depth, measured at the start and learned since."""
        return self.scheduler.draft_cost

    @property
    def recorder(self) -> MetricsRecorder | None:
        """Set it to a :class:`specdec.metrics.MetricsRecorder` to have every verify forward recorded
        (``specdec.generate`` does)."""
        return self.runner.recorder

    @recorder.setter
    def recorder(self, recorder: MetricsRecorder | None) -> None:
        self.runner.recorder = recorder

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One step: the scheduler's plan, the runner's run of it, the scheduler's update; returns the
        outputs of the requests that changed in it."""
        t0 = self.now()
        claim_target(self)  # a dict look-up, unless another user of the target reset its cache
        report = self.runner.run(self.scheduler.schedule())
        self.scheduler.update(report)
        outputs = [self.requests[rid].output(new) for rid, new in report.new_tokens.items()]
        for out in outputs:
            if out.finished:
                self.requests.pop(out.request_id, None)
        self.stats["steps"] += 1
        self.stats["total_s"] += self.now() - t0
        return outputs
