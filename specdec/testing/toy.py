"""Toy language models with a small vocabulary, for exact and Monte-Carlo distribution tests.

Legend: N rows, B batch, T block length, K draft length (γ), V vocabulary, O Markov order,
L cache capacity.

- :class:`MarkovModel`: next-token logits are a table indexed by the last ``order`` tokens, so the
  target's distribution depends on the context (row-specific target rows) and can be enumerated.
- :class:`PositionalModel`: fixed probability rows by position, for i.i.d. draft positions.
- :class:`MarkovTarget` / :class:`MarkovDrafter`: a :class:`MarkovModel` behind the engine's
  :class:`~specdec.protocols.Target` and :class:`~specdec.protocols.Drafter` protocols, so the real
  :func:`specdec.generate` engine can run on it. :class:`MarkovTarget` reads its context from its own
  positional cache and raises on protocol violations (a block that starts past the cached length),
  so an engine that feeds wrong positions or rolls back wrongly changes the output distribution or
  fails loudly instead of passing by luck.

Every model answers ``next_token_probs(contexts, sampling)``: float64 ``[N, V]`` rows, each the
distribution the engine would sample from after that context (logits processed by the real
:func:`specdec.sampling.logits_to_probs`, then renormalised in float64).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from specdec.protocols import DecodeState, Proposal, TargetOutput
from specdec.sampling import SamplingParams, sample_from_probs, sampling_probs
from specdec.verify.noise import PositionNoise, sample_keyed

__all__ = ["NextTokenModel", "MarkovModel", "PositionalModel", "MarkovTarget", "MarkovDrafter"]


@runtime_checkable
class NextTokenModel(Protocol):
    """What the enumeration and Monte-Carlo helpers need from a toy model."""

    vocab_size: int

    def next_token_probs(
        self, contexts: Sequence[Sequence[int]], sampling: SamplingParams | None = None
    ) -> torch.Tensor:
        """float64 ``[N, V]``: the processed next-token distribution after each context."""
        ...


def _as_float64_rows(probs_NV: torch.Tensor) -> torch.Tensor:
    probs_NV = probs_NV.double()
    return probs_NV / probs_NV.sum(dim=-1, keepdim=True)


class MarkovModel:
    """A causal LM whose next-token logits depend only on the last ``order`` tokens.

    ``logits`` has shape ``[V+1] * order + [V]``: entry ``[a, b, :]`` (order 2) holds the logits after
    the tokens ``a, b``. Index ``V`` in a context slot stands for "no token" (before the start of the
    sequence), so short contexts are valid.
    """

    def __init__(self, logits: torch.Tensor, *, eos_token_ids: Sequence[int] = ()) -> None:
        if not isinstance(logits, torch.Tensor) or logits.ndim < 2 or not logits.is_floating_point():
            raise ValueError("logits must be a float tensor of shape [V+1]*order + [V]")
        V = logits.shape[-1]
        if any(d != V + 1 for d in logits.shape[:-1]):
            raise ValueError(
                f"logits must have shape [V+1]*order + [V] with V={V}, got {tuple(logits.shape)}"
            )
        if any(not 0 <= int(t) < V for t in eos_token_ids):
            raise ValueError(f"eos_token_ids must lie in [0, {V}), got {tuple(eos_token_ids)}")
        self.logits = logits.float()
        self.vocab_size = V
        self.order = logits.ndim - 1
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)

    @classmethod
    def random(
        cls,
        vocab_size: int,
        *,
        order: int = 1,
        seed: int = 0,
        scale: float = 1.5,
        eos_token_ids: Sequence[int] = (),
    ) -> MarkovModel:
        """Logits drawn i.i.d. from N(0, scale²): every row is a different, peaked distribution."""
        if vocab_size < 1 or order < 1:
            raise ValueError(f"vocab_size and order must be >= 1, got {vocab_size}, {order}")
        g = torch.Generator().manual_seed(seed)
        shape = [vocab_size + 1] * order + [vocab_size]
        return cls(torch.randn(shape, generator=g) * scale, eos_token_ids=eos_token_ids)

    def context_index(self, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        """The last ``order`` tokens of each context, left-padded with V: long ``[N, O]``."""
        O, V = self.order, self.vocab_size
        rows = []
        for ctx in contexts:
            last = [int(t) for t in ctx[max(0, len(ctx) - O) :]]
            if any(not 0 <= t < V for t in last):
                raise ValueError(f"context tokens must lie in [0, {V}), got {tuple(ctx)}")
            rows.append([V] * (O - len(last)) + last)
        return torch.tensor(rows, dtype=torch.long).reshape(len(rows), O)

    def logits_for(self, last_NO: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, V]`` (float32) after the last-O-token rows ``last_NO`` (V = no token)."""
        return self.logits[tuple(last_NO.unbind(-1))]

    def next_token_probs(
        self, contexts: Sequence[Sequence[int]], sampling: SamplingParams | None = None
    ) -> torch.Tensor:
        """float64 ``[N, V]``: ``logits_to_probs`` of the logits after each context, renormalised."""
        s = sampling or SamplingParams()
        logits_NV = self.logits_for(self.context_index(contexts))
        return _as_float64_rows(sampling_probs(logits_NV, s))

    def as_target(self) -> MarkovTarget:
        """This model behind the :class:`~specdec.protocols.Target` protocol."""
        return MarkovTarget(self)

    def as_drafter(self, *, point_mass: bool = False) -> MarkovDrafter:
        """This model behind the :class:`~specdec.protocols.Drafter` protocol."""
        return MarkovDrafter(self, point_mass=point_mass)


class PositionalModel:
    """Fixed, already processed probability rows: after a context of length t, row ``min(t, T-1)``.

    With one row every position is i.i.d.; sampling parameters do not apply (pass none).
    """

    def __init__(self, probs_TV: torch.Tensor) -> None:
        if not isinstance(probs_TV, torch.Tensor) or not probs_TV.is_floating_point():
            raise ValueError("probs_TV must be a float tensor")
        if probs_TV.ndim == 1:
            probs_TV = probs_TV.unsqueeze(0)
        if probs_TV.ndim != 2 or probs_TV.shape[0] < 1 or probs_TV.shape[1] < 1:
            raise ValueError(f"probs_TV must have shape [T, V] or [V], got {tuple(probs_TV.shape)}")
        if (probs_TV < 0).any() or ((probs_TV.double().sum(-1) - 1).abs() > 1e-6).any():
            raise ValueError("probs_TV rows must be non-negative and sum to 1")
        self.probs_TV = _as_float64_rows(probs_TV)
        self.vocab_size = probs_TV.shape[1]

    def next_token_probs(
        self, contexts: Sequence[Sequence[int]], sampling: SamplingParams | None = None
    ) -> torch.Tensor:
        """The row for each context's length."""
        if sampling is not None and sampling != SamplingParams():
            raise ValueError("PositionalModel holds processed probabilities; sampling params do not apply")
        T = self.probs_TV.shape[0]
        index = torch.tensor([min(len(c), T - 1) for c in contexts], dtype=torch.long)
        return self.probs_TV[index]


class MarkovTarget:
    """A :class:`MarkovModel` as a :class:`~specdec.protocols.Target` with a positional token cache.

    The cache stores the token at every slot; block position t's logits depend on the tokens at slots
    ``start+t-O+1 .. start+t``, the earlier ones read from the cache. ``hidden_BTD`` is None. The slot
    API: ``rows_B`` names the cache rows a call's B rows use (default: rows 0..B-1).
    """

    def __init__(self, model: MarkovModel) -> None:
        self.model = model
        self.vocab_size = model.vocab_size
        self.eos_token_ids = model.eos_token_ids
        self._slots_BL: torch.Tensor | None = None
        self._valid_B: torch.Tensor | None = None

    def reset(self, batch_size: int, max_len: int) -> None:
        """Empty cache for ``batch_size`` rows of ``max_len`` slots."""
        self._slots_BL = torch.full((batch_size, max_len), -1, dtype=torch.long)
        self._valid_B = torch.zeros(batch_size, dtype=torch.long)

    def forward(
        self,
        tokens_BT: torch.Tensor,
        start_B: torch.Tensor,
        *,
        rows_B: torch.Tensor | None = None,
        logits_index_BN: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Write the block at slots ``start_B ..`` of cache rows ``rows_B`` and return its logits
        (``[B, T, V]`` float32)."""
        if self._slots_BL is None or self._valid_B is None:
            raise RuntimeError("MarkovTarget.forward called before reset()")
        B, T = tokens_BT.shape
        rows = self._rows(rows_B, B)
        slots_BL, valid_B = self._slots_BL[rows], self._valid_B[rows]
        L = slots_BL.shape[1]
        start_B = start_B.long().cpu()
        if start_B.shape != (B,):
            raise RuntimeError(f"start_B must have shape [{B}], got {tuple(start_B.shape)}")
        if (start_B > valid_B).any() or (start_B < 0).any():
            raise RuntimeError(
                f"protocol violation: a block starts at slot {start_B.tolist()} but the cache holds "
                f"{valid_B.tolist()} tokens (blocks must start at or before the cached length)"
            )
        if (start_B + T > L).any():
            raise RuntimeError(f"block of {T} tokens at {start_B.tolist()} overflows the cache capacity {L}")
        pos_BT = start_B.unsqueeze(1) + torch.arange(T)
        slots_BL.scatter_(1, pos_BT, tokens_BT.long().cpu())
        self._slots_BL[rows] = slots_BL
        self._valid_B[rows] = start_B + T
        O, V = self.model.order, self.vocab_size
        ctx_pos_BTO = pos_BT.unsqueeze(-1) - torch.arange(O - 1, -1, -1)
        ctx_BTO = slots_BL.gather(1, ctx_pos_BTO.clamp(min=0).reshape(B, -1)).reshape(B, T, O)
        ctx_BTO = torch.where(ctx_pos_BTO >= 0, ctx_BTO, V)
        logits_BTV = self.model.logits_for(ctx_BTO)
        if logits_index_BN is not None:
            index_BN = logits_index_BN.long().cpu()
            logits_BTV = logits_BTV.gather(1, index_BN.unsqueeze(-1).expand(-1, -1, V))
        return TargetOutput(logits_BTV=logits_BTV.to(tokens_BT.device), hidden_BTD=None)

    def _rows(self, rows_B: torch.Tensor | None, B: int) -> torch.Tensor:
        """The cache rows a call uses: ``rows_B`` (distinct, in range) or 0..B-1."""
        assert self._valid_B is not None
        if rows_B is None:
            return torch.arange(B)
        rows = torch.as_tensor(rows_B).long().cpu().reshape(-1)
        n = self._valid_B.shape[0]
        if rows.shape != (B,) or len(set(rows.tolist())) != B or ((rows < 0) | (rows >= n)).any():
            raise RuntimeError(f"rows_B must hold {B} distinct cache rows in [0, {n}), got {rows.tolist()}")
        return rows

    def rollback(self, lengths_B: torch.Tensor, rows_B: torch.Tensor | None = None) -> None:
        """Keep only the first ``lengths_B`` slots per row (of ``rows_B``); declaring unwritten slots
        valid raises."""
        if self._valid_B is None:
            raise RuntimeError("MarkovTarget.rollback called before reset()")
        lengths_B = lengths_B.long().cpu()
        rows = self._rows(rows_B, lengths_B.shape[0])
        valid_B = self._valid_B[rows]
        if (lengths_B > valid_B).any() or (lengths_B < 0).any():
            raise RuntimeError(
                f"protocol violation: rollback to {lengths_B.tolist()} but only {valid_B.tolist()} "
                "slots were written"
            )
        self._valid_B[rows] = lengths_B


class MarkovDrafter:
    """A :class:`MarkovModel` as a :class:`~specdec.protocols.Drafter`: samples γ tokens from its
    own processed rows (``state.sampling``), or proposes its argmax chain as a point mass.

    Stateless, so the engine drafts any set of rows with one instance (``batched_rows``); given
    ``noise`` (:class:`specdec.verify.noise.PositionNoise`, one seed per row) it draws each token keyed by
    its row's seed and output position (stream ``"draft"``), so a row's drafts never depend on the
    rows beside it; else from ``generator``."""

    batched_rows = True

    def __init__(self, model: MarkovModel, *, point_mass: bool = False) -> None:
        self.model = model
        self.point_mass = point_mass

    def begin(self, state: DecodeState, target_out: TargetOutput) -> None:
        """Stateless: the context is read from ``state`` at every proposal."""

    def propose(
        self,
        state: DecodeState,
        gamma: int,
        generator: torch.Generator | None = None,
        *,
        noise: PositionNoise | None = None,
    ) -> Proposal:
        """``gamma`` tokens per row continuing each row's committed tokens."""
        O, V = self.model.order, self.model.vocab_size
        B = state.batch_size
        index_BO = state.lengths_B.unsqueeze(1) - O + torch.arange(O, device=state.lengths_B.device)
        ctx_BO = state.tokens_BL.gather(1, index_BO.clamp(min=0))
        ctx_BO = torch.where(index_BO >= 0, ctx_BO, V).cpu()
        position_B = (state.lengths_B - state.prompt_lengths_B).cpu()  # output position of draft 1
        s = state.sampling
        tokens, probs = [], []
        for k in range(gamma):
            probs_BV = sampling_probs(self.model.logits_for(ctx_BO), s)
            if self.point_mass:
                x_B = probs_BV.argmax(dim=-1)
            elif noise is not None:
                x_B = sample_keyed(probs_BV, noise, position_B + k, stream="draft")
            else:
                x_B = sample_from_probs(probs_BV, generator)
            tokens.append(x_B)
            probs.append(probs_BV)
            ctx_BO = torch.cat([ctx_BO[:, 1:], x_B.unsqueeze(1)], dim=1)
        device = state.tokens_BL.device
        tokens_BK = torch.stack(tokens, 1) if tokens else torch.empty((B, 0), dtype=torch.long)
        if self.point_mass:
            return Proposal(tokens_BK=tokens_BK.to(device), probs_BKV=None)
        probs_BKV = torch.stack(probs, 1) if probs else torch.empty((B, 0, V))
        return Proposal(tokens_BK=tokens_BK.to(device), probs_BKV=probs_BKV.to(device))

    def observe(self, state: DecodeState, num_accepted_B: torch.Tensor, target_out: TargetOutput) -> None:
        """Nothing to roll back."""
