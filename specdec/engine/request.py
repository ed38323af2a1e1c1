"""One request of the engine: its prompt, sampling settings, seed, stop conditions, output and metrics.

Legend: K draft length of one step.

A :class:`Request` owns everything that belongs to one generation: the
engine's scheduler only decides *when* it runs and *where* (its cache slot). Its random stream is
public randomness keyed by (seed, sequence position) (:mod:`specdec.verify.noise`), so what it emits never
depends on which other requests share its steps.
"""

from __future__ import annotations

import enum
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from specdec.engine.faults import log
from specdec.engine.logprobs import TokenLogprob, check_num_logprobs, token_logprobs
from specdec.logits.processors import Processors
from specdec.sampling import SamplingParams
from specdec.seeds import check_seed
from specdec.stop_strings import StopStrings

__all__ = [
    "RequestStatus",
    "RequestParams",
    "RequestMetrics",
    "RequestOutput",
    "Request",
    "check_prompt",
    "make_params",
    "positive_int",
]


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued: no cache slot yet
    PREFILL = "prefill"  # has a slot; its prompt is being prefilled in chunks
    DECODE = "decode"  # first token sampled; speculative steps
    FINISHED = "finished"


@dataclass(frozen=True, kw_only=True)
class RequestParams:
    """A request's own settings (validated by :func:`make_params`)."""

    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    stop_strings: tuple[str, ...] = ()
    eos_token_ids: frozenset[int] = frozenset()
    logprobs: int | None = None  # alternatives per generated token (None: no log-probabilities)
    prompt_logprobs: int | None = None  # alternatives per prompt token (None: none)
    speculative: bool = True  # False: never drafts (plain decoding; its drafted count stays 0)


def positive_int(value: Any, name: str) -> int:
    """``value`` as an int >= 1 (numpy integers too); ``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def _plain_number(value: Any) -> Any:
    """A numpy (or other ``numbers``) scalar as the Python ``int`` / ``float`` it stands for; anything
    else as it is (the checks that follow name what was expected)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def _string_list(value: Any, name: str) -> tuple[str, ...]:
    """``stop_strings``: None or a list (any non-string sequence) of non-empty strings."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, set, frozenset)):
        raise ValueError(f"{name} must be a list of non-empty strings, got {value!r:.80}")
    if not all(isinstance(s, str) and s for s in value):
        raise ValueError(f"{name} must be a list of non-empty strings, got {value!r:.80}")
    return tuple(value)


def _token_id_list(value: Any, name: str, vocab_size: int) -> list[int]:
    """``eos_token_ids``: a list (any non-string sequence or set) of token ids in [0, vocab_size)."""
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
        value = value.tolist()  # a numpy array or tensor
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, set, frozenset)):
        raise ValueError(f"{name} must be a list of token ids in [0, {vocab_size}), got {value!r:.80}")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab_size:
            raise ValueError(f"{name} holds {t!r}; token ids must be ints in [0, {vocab_size})")
    return [int(t) for t in value]


def check_prompt(prompt_ids: Any, vocab_size: int) -> list[int]:
    """A prompt as a list of token ids in ``[0, vocab_size)`` (a tensor or numpy array too);
    ``ValueError`` naming ``prompt_ids`` otherwise."""
    if hasattr(prompt_ids, "tolist") and not isinstance(prompt_ids, list):
        prompt_ids = prompt_ids.tolist()
    if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Sequence) or not prompt_ids:
        raise ValueError(f"prompt_ids must be a non-empty list of token ids, got {prompt_ids!r:.80}")
    ids = []
    for t in prompt_ids:  # numpy integers are ints here too (numbers.Integral)
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab_size:
            raise ValueError(f"prompt_ids holds {t!r}; token ids must be ints in [0, {vocab_size})")
        ids.append(int(t))
    return ids


def make_params(
    *,
    max_new_tokens: Any,
    temperature: Any,
    top_k: Any,
    top_p: Any,
    seed: Any,
    stop_strings: Any,
    eos_token_ids: Any,
    ignore_eos: Any,
    default_eos: Sequence[int],
    vocab_size: int,
    logprobs: Any = None,
    prompt_logprobs: Any = None,
    speculative: Any = True,
    processors: dict[str, Any] | None = None,
) -> RequestParams:
    """Check ``add_request``'s arguments; ``ValueError`` naming the first bad one. Numpy scalars are
    taken where Python ints and floats are (``numpy.bool_`` is not a bool: refused like any non-bool).
    ``processors``: the :class:`~specdec.sampling.SamplingParams` fields past top-p (``min_p``, the
    penalties, ``logit_bias``, ``min_tokens``) given by the caller; None values take the defaults."""
    max_new_tokens = positive_int(max_new_tokens, "max_new_tokens")
    extra = {k: _plain_number(v) for k, v in (processors or {}).items() if v is not None}
    sampling = SamplingParams(  # validates
        temperature=_plain_number(temperature),
        top_k=_plain_number(top_k),
        top_p=_plain_number(top_p),
        **extra,
    )
    seed = 0 if seed is None else check_seed(seed)
    stops = _string_list(stop_strings, "stop_strings")
    if not isinstance(ignore_eos, bool):
        raise ValueError(f"ignore_eos must be a bool, got {ignore_eos!r}")
    if not isinstance(speculative, bool):
        raise ValueError(f"speculative must be a bool, got {speculative!r:.80}")
    if eos_token_ids is None:
        ids = _token_id_list(list(default_eos), "the target's eos_token_ids", vocab_size)
    else:
        ids = _token_id_list(eos_token_ids, "eos_token_ids", vocab_size)
    eos = frozenset() if ignore_eos else frozenset(ids)
    return RequestParams(
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        seed=seed,
        stop_strings=stops,
        eos_token_ids=eos,
        logprobs=check_num_logprobs(logprobs, "logprobs", vocab_size),
        prompt_logprobs=check_num_logprobs(prompt_logprobs, "prompt_logprobs", vocab_size),
        speculative=speculative,
    )


@dataclass
class RequestMetrics:
    """One request's own measurements (seconds on the engine's clock).

    ``ttft_s``: arrival to first token. ``token_times_s``: when each generated token was committed
    (a step's tokens share its end time). ``num_drafted`` / ``num_accepted``: draft tokens verified
    for this request and accepted; ``num_steps``: verify calls it took part in (plain steps too).
    """

    arrival_s: float = 0.0
    first_token_s: float | None = None
    finished_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    num_drafted: int = 0
    num_accepted: int = 0
    num_steps: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    """Entry k: how many times draft position k+1 was accepted (vLLM's per-position counter)."""
    depth_changes: int = 0
    """How many times the depth this request drafted at changed from one step to its next."""
    last_depth: int | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def acceptance_rate(self) -> float:
        """α: accepted drafts / drafted tokens (0 when nothing was drafted)."""
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        """τ: tokens per verify call (accepted drafts + the recovered or bonus token)."""
        return (self.num_accepted + self.num_steps) / self.num_steps if self.num_steps else 0.0

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first: ``(last − first) / (n − 1)``."""
        t = self.token_times_s
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "num_drafted": self.num_drafted,
            "num_accepted": self.num_accepted,
            "num_steps": self.num_steps,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_tokens": self.mean_accepted_tokens,
            "accepted_per_pos": list(self.accepted_per_pos),
            "depth_changes": self.depth_changes,
        }


@dataclass
class RequestOutput:
    """What :meth:`specdec.Engine.step` returns for a request that changed in that step.

    For a request that asked for them (:mod:`specdec.engine.logprobs`): ``logprobs`` one entry per
    token of ``token_ids`` (``new_logprobs``: of ``new_token_ids``), and ``prompt_logprobs`` one per
    prompt token (the first None), once the prompt is prefilled; None for a request that did not ask.
    """

    request_id: str
    new_token_ids: list[int]
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics
    new_logprobs: list[TokenLogprob] | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None
    """Why the request failed (``finish_reason`` ``"error"``: :mod:`specdec.engine.faults`); else None."""


class Request:
    """A request's state while the engine holds it."""

    def __init__(
        self, request_id: str, prompt_ids: list[int], params: RequestParams, stops: StopStrings | None
    ) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.stops = stops
        self.status = RequestStatus.WAITING
        self.slot: int | None = None
        self.num_prefilled = 0
        self.generated: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None  # the message of a request that failed alone
        self.metrics = RequestMetrics()
        self.prefill_parts: list[Any] = []  # the prefill chunks' target outputs, for drafter.add
        # Decayed acceptance counts per draft position (the depth controller's estimate a_k).
        self.accepted_k: list[float] = []
        self.idle_steps = 0  # steps since it last drafted (the engine probes after PROBE_EVERY)
        self.reached_k: list[float] = []
        self.processors: Processors | None = None  # its logits processors (specdec.logits), if any
        self.logprobs: list[TokenLogprob] | None = None if params.logprobs is None else []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first prompt token has no log-probability

    @property
    def length(self) -> int:
        """Tokens in the sequence: prompt + generated."""
        return len(self.prompt_ids) + len(self.generated)

    @property
    def room(self) -> int:
        """New tokens it may still emit."""
        return self.params.max_new_tokens - len(self.generated)

    def commit(self, new: list[int]) -> list[int]:
        """Append new tokens cut at the stop conditions; returns what was kept, sets the finish reason."""
        p = self.params
        new = new[: self.room]
        reason = None
        for i, t in enumerate(new):
            if t in p.eos_token_ids:
                new, reason = new[: i + 1], "eos"
                break
        if self.stops is not None and new:
            num_old = len(self.generated)
            end = self.stops.first_stop(self.generated + new, num_old)
            if end is not None:
                new, reason = new[: end - num_old], "stop_string"
        self.generated.extend(new)
        if self.processors is not None:
            self.processors.commit(new)
            if reason is None and self.processors.ended is not None:
                reason = "grammar"
                log.info("request %s stops: %s", self.request_id, self.processors.ended)
        if reason is None and self.room <= 0:
            reason = "length"
        if reason is not None:
            self.finish_reason = reason
        return new

    def record_logprobs(self, kept: list[int], logits_NV: Any) -> None:
        """The log-probabilities of the tokens just committed (``kept``), if the request asked for
        them; ``logits_NV``: the logits that decided them, one row per token (more rows: ignored)."""
        if self.logprobs is not None and kept:
            self.logprobs += token_logprobs(logits_NV[: len(kept)], kept, self.params.logprobs)

    def record_prompt_logprobs(self, logits_NV: Any, start: int) -> None:
        """The log-probabilities of the prompt tokens that the logits of a prefill chunk beginning at
        prompt position ``start`` score (position j scores token ``start + j + 1``)."""
        if self.prompt_logprobs is None:
            return
        scored = self.prompt_ids[start + 1 : start + 1 + logits_NV.shape[0]]
        if scored:
            self.prompt_logprobs += token_logprobs(
                logits_NV[: len(scored)], scored, self.params.prompt_logprobs
            )

    def acceptance(self, k: int, prior: float, prior_weight: float) -> float:
        """The estimate a_k that draft position k (1-based) is accepted given position k−1 was."""
        if k <= len(self.reached_k):
            acc, reached = self.accepted_k[k - 1], self.reached_k[k - 1]
        else:
            acc = reached = 0.0
        return (acc + prior * prior_weight) / (reached + prior_weight)

    def learn(self, num_drafted: int, num_accepted: int, decay: float) -> None:
        """Record one verified draft ``num_drafted`` deep, the first ``num_accepted`` accepted (the
        acceptance estimates and the accepted counters; the caller counts drafted tokens)."""
        while len(self.reached_k) < num_drafted:
            self.reached_k.append(0.0)
            self.accepted_k.append(0.0)
        for k in range(len(self.reached_k)):
            self.reached_k[k] *= decay
            self.accepted_k[k] *= decay
        for k in range(min(num_accepted + 1, num_drafted)):
            self.reached_k[k] += 1.0
            if k < num_accepted:
                self.accepted_k[k] += 1.0
        m = self.metrics
        m.num_accepted += num_accepted
        m.depth_changes += m.last_depth is not None and m.last_depth != num_drafted
        m.last_depth = num_drafted
        while len(m.accepted_per_pos) < num_drafted:
            m.accepted_per_pos.append(0)
        for k in range(num_accepted):
            m.accepted_per_pos[k] += 1

    def output(self, new: list[int]) -> RequestOutput:
        logprobs = None if self.logprobs is None else list(self.logprobs)
        prompt_done = self.status is not RequestStatus.WAITING and self.num_prefilled == len(self.prompt_ids)
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=list(new),
            token_ids=list(self.generated),
            finished=self.status is RequestStatus.FINISHED,
            finish_reason=self.finish_reason,
            metrics=self.metrics,
            new_logprobs=None if logprobs is None else logprobs[len(logprobs) - len(new) :],
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs if prompt_done else None,
            error=self.error,
        )
