"""The continuous-batching engine: requests join and leave at every step.

Legend: B rows decoding in a step, K a row's draft depth, T = K + 1 its verify block, T_max the
step's longest block, V vocabulary, D hidden size, L cache slots per row (``max_model_len``).

Each :meth:`Engine.step`:

1. **admit** waiting requests into free cache rows (first come, first served; the queue is
   unbounded: a full engine queues, it never drops a request);
2. **depths**: one controller (:mod:`specdec.engine.depth`) gives every decoding request its draft
   depth (0 = a plain step) from the measured verify cost of the whole step
   (:mod:`specdec.engine.cost_model`), the drafting cost of the rows that draft
   (:mod:`specdec.engine.draft_cost`) and that request's own acceptance;
3. **decode**: every decoding request's drafter proposes (one drafter instance per request, or one
   slot drafter for every row, the names in :data:`specdec.registry.SLOT_DRAFTERS`:
   :mod:`specdec.engine.drafting`);
   the chains go through **one** target forward, each row at its own cache row and position,
   padded to T_max (the padding lands past the row's length and is never attended); a token tree
   goes through a forward of its own (its mask is per tree); each row is verified by the rule with
   its own sampling settings and public randomness keyed by its seed and sequence positions
   (:mod:`specdec.verify.noise`), committed, cut at its stops, its cache row rolled back, and its
   drafter observes (:mod:`specdec.engine.decode`). Rows travel in units
   (:mod:`specdec.engine.units`): a batched drafter drafts many rows in one call, and rows sharing
   depth and sampling settings are verified by one rule call and rolled back by one call, so
   thousands of rows cost no Python per row beyond their commits;
4. **prefill**: with the token budget left (``max_num_batched_tokens``), prompts are prefilled in
   chunks of ``prefill_chunk`` tokens at fixed boundaries (a chunk is the same forward whatever else
   runs in the step; the chunks of one length run as one forward, each row at its own cache row); a
   prompt's last chunk samples its first token, and its drafter begins.

A finished or aborted request leaves at once and its row is reused; finished rows are never
computed again. What a request emits depends on its prompt, settings, seed and drafter only
(never on its neighbours or on timings): greedy rows take the target's argmax whatever their
depth, ``gumbel`` rows reproduce plain keyed decoding whatever their depth, and the depth of a
sampled ``exact`` row depends on its own acceptance only. This needs the target's forward to give a
row the same logits whatever the other rows of the block are (batch invariance).
"""

from __future__ import annotations

import heapq
import inspect
import itertools
import numbers
import secrets
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from specdec.checks import check_logits, logits_faults
from specdec.engine.cost_model import VerifyCostModel, verify_cost_for
from specdec.engine.decode import DecodeSteps, mix_seed, raise_faults
from specdec.engine.depth import DepthPolicy, FixedDepth, RowView, make_depth_policy
from specdec.engine.draft_cost import DraftCost, measure_draft_cost
from specdec.engine.drafting import DrafterPool, join_outputs, row_state
from specdec.engine.logprobs import last_logits_only, prefill_logits_index
from specdec.engine.request import Request, RequestOutput, RequestStatus, make_params
from specdec.engine.transfer import HostTransfer
from specdec.engine.units import group_state, row_output
from specdec.host_sync import avoids_host
from specdec.metrics import MetricsRecorder
from specdec.protocols import Drafter, Target, TargetOutput, TreeTarget
from specdec.sampling import logits_to_probs
from specdec.stop_strings import StopStrings
from specdec.verify.contract import VerifyRule
from specdec.verify.noise import PositionNoise, sample_keyed
from specdec.verify.registry import make_verify_rule

__all__ = ["Engine", "mix_seed", "scheduler_seconds"]

_PRIOR, _PRIOR_WEIGHT = 0.6, 3.0  # the prior of the acceptance estimates a_k per request
TREE_BLOCK, TREE_COST_RATIO = 12, 1.6
"""A drafter that can draft a chain or a tree is told trees pay (``DecodeState.tree_ok``) where a
verify block of ``TREE_BLOCK`` tokens (a tree of 11 nodes and its root) costs at most
``TREE_COST_RATIO`` times one token, and the row is verified alone in its step."""
PROBE_EVERY = 16
"""A row free to follow timings that drafted nothing for this many steps drafts one token (a probe),
so its acceptance estimate follows the text even where the policy chose plain steps; the other free
rows idle for at least half as long probe in the same step (one padded forward for all of them),
and only where a 2-token block of the step's rows costs at most ``PROBE_COST_RATIO`` times one token
(on this CPU: one to two rows, not four or eight)."""
PROBE_COST_RATIO = 1.25
PROBE_ACCEPTANCE = 0.8
"""The acceptance at which a probe's draft must be able to pay (see ``Engine._probe_pays``)."""


def scheduler_seconds(stats: Mapping[str, float]) -> float:
    """The engine's own time in :attr:`Engine.stats` (or a difference of two snapshots): a step's
    time outside the target's forwards, the drafters and the verification rule (admission, the
    depth controller, block assembly, commit, stop strings, rollback, bookkeeping)."""
    return stats["total_s"] - stats["forward_s"] - stats["draft_s"] - stats["rule_s"]


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


class Engine(DecodeSteps):
    """Continuous batching with speculative decoding over one target (see the module doc).

    Args:
        target: a :class:`specdec.protocols.Target` whose ``forward`` / ``rollback`` take ``rows_B``
            (the native ``llama`` target and the ``hf`` target do).
        drafter: a registered drafter name, built with ``drafter_options``: one
            :class:`~specdec.protocols.SlotDrafter` for every request for a name in
            :data:`specdec.registry.SLOT_DRAFTERS` (``eagle``, ``ngram-eagle``, ``ngram-eagle-auto``,
            ``model``, ``qself``, ``layerskip``, ``ngram``), an instance per request for the others
            (``eagle-tree``, ``ngram-eagle-tree``, ``unigram``, ``bigram``). ``default``: the shipped
            EAGLE head with prompt lookup where the target has one, else prompt lookup. Or a drafter
            object: a ``SlotDrafter`` serves every request; another serves the first request, and
            the requests beside it get instances from its ``slot_factory`` or deep copies
            (:mod:`specdec.engine.drafting`).
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
        measure_cost: time the verify-cost grid (policies that read it; measured once per target
            and row count, :func:`specdec.engine.cost_model.verify_cost_for`); False uses none.
        tokenizer: for stop strings (default ``target.tokenizer``).

    ``recorder``: set it to a :class:`specdec.metrics.MetricsRecorder` to have every verify forward
    recorded (``specdec.generate`` does).

    ``stats`` (seconds, summed over every step): ``total_s`` inside :meth:`step`; ``forward_s`` the
    target's forwards (prefill chunks included, ``prefill_s``); ``draft_s`` the drafters (``propose``,
    ``begin`` (``begin_s``) and ``observe``), of which ``owed_s`` is catch-up owed once (a prompt's, or
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
        self.max_num_seqs = _positive_int(max_num_seqs, "max_num_seqs")
        self.budget = _positive_int(max_num_batched_tokens, "max_num_batched_tokens")
        self.prefill_chunk = _positive_int(prefill_chunk, "prefill_chunk")
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
        self.max_model_len = _positive_int(
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
        self.tree_ok = isinstance(target, TreeTarget)
        target.reset(self.max_num_seqs, self.max_model_len)
        self.cost: VerifyCostModel | None = None
        if measure_cost and not isinstance(self.policy, FixedDepth):
            self.cost = verify_cost_for(target, max_rows=self.max_num_seqs)
        # Trees (drafters that can draft either) only where a tree-sized block costs little more
        # than one token (without a cost model, wherever the target takes trees).
        self.tree_pays = self.tree_ok and (
            self.cost is None or self.cost.cost(1, TREE_BLOCK) <= TREE_COST_RATIO * self.cost.cost(1, 1)
        )
        self._trees_now = False  # this step's DecodeState.tree_ok
        self.drafters = DrafterPool(target, drafter, drafter_options, num_slots=self.max_num_seqs)
        self.drafter_name = self.drafters.name
        # drafting seconds per step by drafting rows and depth: a slot drafter's measured at the start
        self.draft_cost = DraftCost()
        if self.cost is not None and self.drafters.slots is not None:
            self.draft_cost = measure_draft_cost(target, self.drafters.slots, rows=self.cost.rows)
        self._free_heap = list(range(self.max_num_seqs))  # a heap: the lowest free row first
        # Every request's tokens (prompt, then committed), one row per slot; a request's DecodeState
        # is a view of its row. Slots past a row's length are undefined.
        self.tokens_SL = torch.zeros((self.max_num_seqs, self.max_model_len), dtype=torch.long)
        self._tokens_np = self.tokens_SL.numpy()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.stats = {
            "steps": 0, "total_s": 0.0, "forward_s": 0.0, "draft_s": 0.0, "verify_s": 0.0,
            "prefill_s": 0.0, "begin_s": 0.0, "rule_s": 0.0, "owed_s": 0.0,
        }  # fmt: skip
        self.now = time.perf_counter
        self.recorder: MetricsRecorder | None = None

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
    ) -> str:
        """Queue a request; returns its id. ``seed`` None draws one at random (the output is then
        fixed by that seed, readable as ``engine.requests[id].params.seed``). ``logprobs``,
        ``prompt_logprobs``: :mod:`specdec.engine.logprobs` (None: not reported)."""
        if hasattr(prompt_ids, "tolist") and not isinstance(prompt_ids, list):
            prompt_ids = prompt_ids.tolist()
        if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Sequence) or not prompt_ids:
            raise ValueError(f"prompt_ids must be a non-empty list of token ids, got {prompt_ids!r:.80}")
        ids = []
        for t in prompt_ids:  # numpy integers are ints here too (numbers.Integral)
            if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt_ids holds {t!r}; token ids must be ints in [0, {self.vocab_size})")
            ids.append(int(t))
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
        )
        needed = len(ids) + params.max_new_tokens + self.gamma_max + 1
        if needed > self.max_model_len:  # the prompt is to blame where it leaves no room for one token
            full = needed - params.max_new_tokens + 1 > self.max_model_len
            raise ValueError(
                f"{'prompt_ids' if full else 'max_new_tokens'}: the prompt ({len(ids)} tokens) + "
                f"max_new_tokens ({params.max_new_tokens}) + gamma + 1 ({self.gamma_max + 1}) = {needed} "
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
        request.metrics.arrival_s = self.now()
        self.requests[request_id] = request
        self.waiting.append(request)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now (finish reason ``abort``), free its row, return its final output (the
        abort's only report: :meth:`step` never returns it); None if it is not here."""
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {request_id!r:.80}")
        if (request := self.requests.pop(request_id, None)) is None:
            return None
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.finish_reason = "abort"
        self._release(request)
        self.running = [r for r in self.running if r is not request]
        return request.output([])

    def reset_target(self) -> None:
        """Prepare the target's cache for this engine again, after another user of the same target
        (``specdec.generate`` or another engine) reset it; only while no request is here."""
        if self.has_unfinished():
            raise ValueError("reset_target() needs an idle engine: requests are waiting or running")
        self.target.reset(self.max_num_seqs, self.max_model_len)

    def has_unfinished(self) -> bool:
        """True while a request waits or runs."""
        return bool(self.waiting or self.running)

    @property
    def free_rows(self) -> list[int]:
        """Cache rows no request holds, in order."""
        return sorted(self._free_heap)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One scheduler step; returns the outputs of the requests that changed in it."""
        t0 = self.now()
        changed: dict[str, list[int]] = {}
        self._admit()
        budget = self.budget
        decoding = [r for r in self.running if r.status is RequestStatus.DECODE]
        if decoding:
            depths = self._depths(decoding)
            budget -= self._decode(decoding, depths, changed)
        self._prefill(budget, changed)
        self.running = [r for r in self.running if r.status is not RequestStatus.FINISHED]
        outputs = [self.requests[rid].output(new) for rid, new in changed.items()]
        for out in outputs:
            if out.finished:
                self.requests.pop(out.request_id, None)
        self.stats["steps"] += 1
        self.stats["total_s"] += self.now() - t0
        return outputs

    # --- scheduling -----------------------------------------------------------------------------
    def _admit(self) -> None:
        while self.waiting and self._free_heap:
            request = self.waiting.popleft()
            request.slot = heapq.heappop(self._free_heap)  # the lowest free row
            request.status = RequestStatus.PREFILL
            slot = request.slot
            request.state = row_state(
                request.prompt_ids,
                self.max_model_len,
                request.params.sampling,
                self.tokens_SL[slot : slot + 1],
            )
            request.lengths_np = request.state.lengths_B.numpy()
            self.running.append(request)

    def _release(self, request: Request) -> None:
        """Free a finishing request's row and drafter (it leaves ``running`` at the step's end)."""
        self.drafters.give_back(request.drafter, request.slot)
        request.drafter = None
        if request.slot is not None:
            heapq.heappush(self._free_heap, request.slot)
            request.slot = None
        request.status = RequestStatus.FINISHED
        request.prefill_parts = []
        request.metrics.finished_s = self.now()

    def _free(self, request: Request) -> bool:
        """May this row's depth follow load and timings without changing its output?"""
        return request.params.sampling.greedy or getattr(self.rule, "drafter_invariant", False)

    def _depths(self, rows: list[Request]) -> list[int]:
        views = []
        for r in rows:
            cap = max(0, min(self.gamma_max, r.room - 1))
            acc = [r.acceptance(k, _PRIOR, _PRIOR_WEIGHT) for k in range(1, cap + 1)]
            views.append(RowView(acc, cap, self._free(r)))
        depths = self.policy.depths(views, self.cost, self.draft_cost)
        # Probes share a step: a probe pads every row of the forward to 2 tokens, so once one row is
        # due, the rows at least half-way there probe with it (their counters then run in step).
        idle = [
            r.idle_steps if d == 0 and v.free and v.cap >= 1 else -1
            for r, v, d in zip(rows, views, depths, strict=True)
        ]
        if max(idle, default=-1) >= PROBE_EVERY and self._probe_pays(len(rows)):
            depths = [1 if n >= PROBE_EVERY // 2 else d for n, d in zip(idle, depths, strict=True)]
        return depths

    def _probe_pays(self, B: int) -> bool:
        """A probe step of ``B`` rows costs at most ``PROBE_COST_RATIO`` times a plain one and a drafted
        token could pay at acceptance ``PROBE_ACCEPTANCE`` with the measured draft costs (no cost
        model: always); else drafting cannot pay at this load, and a probe would only cost."""
        if self.cost is None:
            return True
        one, two = self.cost.cost(B, 1), self.cost.cost(B, 2)
        drafting = two + self.draft_cost.step_seconds([1] * B)
        return two <= PROBE_COST_RATIO * one and (1 + PROBE_ACCEPTANCE) / drafting > 1 / one

    # --- prefill --------------------------------------------------------------------------------
    def _prefill(self, budget: int, changed: dict[str, list[int]]) -> None:
        """Prefill chunks within ``budget``, in rounds: each round takes the next chunk of every
        prefilling request (first come first served, while the budget lasts), and the chunks of one
        length run as one forward (each row at its own cache row and start)."""
        while True:
            chunks: dict[int, list[Request]] = {}
            for request in self.running:
                if request.status is not RequestStatus.PREFILL:
                    continue
                n = min(self.prefill_chunk, len(request.prompt_ids) - request.num_prefilled)
                if n > budget:
                    break
                budget -= n
                chunks.setdefault(n, []).append(request)
            if not chunks:
                return
            for n, rows in chunks.items():
                self._prefill_chunks(rows, n, changed)

    def _prefill_chunks(self, rows: list[Request], n: int, changed: dict[str, list[int]]) -> None:
        """The next ``n`` prompt tokens of every row in one forward; rows whose prompt is complete
        sample their first token (output position 0) and their drafters begin."""
        tokens_GT = torch.tensor(
            [r.prompt_ids[r.num_prefilled : r.num_prefilled + n] for r in rows], dtype=torch.long
        )
        t0 = self.now()
        out = self.target.forward(
            tokens_GT,
            torch.tensor([r.num_prefilled for r in rows]),
            rows_B=torch.tensor([r.slot for r in rows]),
            logits_index_BN=prefill_logits_index(rows, n),
        )
        self.stats["forward_s"] += self.now() - t0
        self.stats["prefill_s"] += self.now() - t0
        done: list[tuple[Request, int]] = []
        for i, request in enumerate(rows):
            request.record_prompt_logprobs(out.logits_BTV[i], request.num_prefilled)
            request.prefill_parts.append(last_logits_only(row_output(out, i)))
            request.num_prefilled += n
            if request.num_prefilled == len(request.prompt_ids):
                done.append((request, i))
        if not done:
            return
        # The first tokens on the target's device, read in one copy with the logits' check.
        transfer = HostTransfer(out.logits_BTV.device)
        if avoids_host(out.logits_BTV):
            transfer.add("faults", logits_faults(out.logits_BTV)[None])
        else:
            check_logits(out.logits_BTV, step="prefill", source="the target")
        by_sampling: dict[Any, list[tuple[Request, int]]] = {}
        for request, i in done:
            by_sampling.setdefault(request.params.sampling, []).append((request, i))
        for g, (sampling, group) in enumerate(by_sampling.items()):
            logits_GV = out.logits_BTV[[i for _, i in group], -1]
            if sampling.greedy:
                transfer.add(f"first{g}", logits_GV.argmax(dim=-1))
                continue
            probs_GV = logits_to_probs(
                logits_GV, sampling.temperature, sampling.top_k, sampling.top_p, validate=False
            )
            noise = PositionNoise([r.params.seed for r, _ in group], device=logits_GV.device)
            zeros_G = torch.zeros(len(group), dtype=torch.long, device=logits_GV.device)
            transfer.add(f"first{g}", sample_keyed(probs_GV, noise, zeros_G, validate=False))
        fetched = transfer.fetch()
        raise_faults(fetched, [lambda: check_logits(out.logits_BTV, step="prefill", source="the target")])
        for g, (sampling, group) in enumerate(by_sampling.items()):
            first = fetched[f"first{g}"].tolist()
            logits_GV = out.logits_BTV[[i for _, i in group], -1]
            t_first = self.now()
            started = []
            for j, ((request, _), token) in enumerate(zip(group, first, strict=True)):
                request.metrics.first_token_s = t_first
                self._commit(request, [token], changed, logits_GV[j : j + 1])
                if request.status is not RequestStatus.FINISHED:
                    request.status = RequestStatus.DECODE
                    started.append(request)
            self._begin(started, sampling)

    def _begin(self, rows: list[Request], sampling: Any) -> None:
        """Drafters begin on prefilled rows: a batched drafter once for all of them, others per row."""
        if not rows:
            return
        t0 = self.now()
        if self.drafters.slots is not None:  # one drafter: each row's slot added
            for r in rows:
                self.drafters.slots.add(r.slot, r.prompt_ids, join_outputs(r.prefill_parts))
                r.drafter = self.drafters.slots
                r.prefill_parts = []
        elif self.drafters.batched:
            drafter = self.drafters.fresh(0)
            parts = [r.prefill_parts[-1] for r in rows]
            drafter.begin(
                group_state(rows, sampling, self.tokens_SL),
                TargetOutput(torch.cat([p.logits_BTV for p in parts])),
            )
            for r in rows:
                r.drafter = drafter
                r.prefill_parts = []
        else:
            for r in rows:
                r.drafter = self.drafters.fresh(r.slot)
                r.drafter.begin(r.state, join_outputs(r.prefill_parts))
                r.prefill_parts = []
        self.stats["draft_s"] += self.now() - t0
        self.stats["begin_s"] += self.now() - t0

    def _commit(self, request: Request, tokens: list[int], changed: dict, logits_NV: Any = None) -> list[int]:
        n0 = request.length
        kept = request.commit(tokens)
        request.record_logprobs(kept, logits_NV)
        state = request.state
        if kept:
            self._tokens_np[request.slot, n0 : n0 + len(kept)] = kept
            request.lengths_np[0] += len(kept)  # in place: state.lengths_B
            t = self.now()
            request.metrics.token_times_s.extend([t] * len(kept))
        changed.setdefault(request.request_id, []).extend(kept)
        if request.finish_reason is not None:
            state.finished_B = torch.ones(1, dtype=torch.bool)
            self._release(request)
        return kept
