"""Boundary checks of what plugins hand the engine: every proposal, every block of target logits.

Legend: B batch, K draft length, N tree nodes, T block length, V vocabulary.

Exactness holds for *any* proposal drawn from the distribution the drafter reports, but only if
that report is a distribution: a drafter that returns negative, infinite or unnormalised
probabilities, float token ids, or tensors of the wrong shape would bias the output silently. So
the engine runs :func:`check_proposal` on every proposal of every step (third-party drafters and our
own alike) and :func:`check_logits` on every target output, and stops with a ``ValueError`` that
names the step, the row and the source. Both cost one or two reductions over tensors the engine
reads anyway (``specdec bench`` reports the time per step as ``check_time_s``).

On an accelerator a check must not read the host: :func:`logits_faults` and :func:`proposal_faults`
compute the same conditions as one bool on the device, which the engine brings to the host with the
step's committed tokens; where it is set, the full check runs and raises its message.
"""

from __future__ import annotations

import numpy as np
import torch

from specdec.protocols import Proposal

__all__ = [
    "check_proposal",
    "check_logits",
    "logits_faults",
    "proposal_faults",
    "PROB_SUM_ATOL",
    "value_range",
]

PROB_SUM_ATOL = 1e-3
"""Tolerance on Σ probs = 1 (float32 sums over a 50k vocabulary are off by ~1e-5)."""

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def value_range(values: torch.Tensor) -> tuple[int | float, int | float]:
    """(min, max) of a non-empty tensor as Python numbers; on the CPU through numpy (one pass each,
    single-threaded: a few µs where two ATen reductions and ``.item()`` cost tens)."""
    if values.device.type == "cpu" and values.dtype != torch.bfloat16:
        array = values.detach().numpy()
        return array.min().item(), array.max().item()
    return values.min().item(), values.max().item()


def check_logits(logits_BTV: torch.Tensor, *, step: int | str, source: str) -> None:
    """``ValueError`` unless every row of ``logits [..., V]`` is finite (``-inf`` entries are allowed,
    a row of only ``-inf`` is not): NaN or ``+inf`` from a target or a draft head stops the run."""
    if logits_BTV.device.type == "cpu" and logits_BTV.dtype == torch.float32:
        # numpy's single-threaded reduction: ~20 µs for a 49k vocabulary, where ATen's parallel one
        # waits on waking OpenMP threads (~0.4 ms a step on 2 cores)
        row_max_np = logits_BTV.detach().numpy().max(axis=-1)
        if bool(np.isfinite(row_max_np).all()):
            return
    row_max = logits_BTV.amax(dim=-1)  # propagates NaN; +inf, and -inf for an all -inf row
    bad = ~torch.isfinite(row_max)
    if bool(bad.any()):
        where = tuple(bad.nonzero()[0].tolist())
        when = step if isinstance(step, str) else f"step {step}"
        raise ValueError(
            f"{when}: {source} returned non-finite logits (NaN, +inf, or a row of only -inf) at "
            f"(row, position) {where}; value {float(row_max[where]):.4g}"
        )


def logits_faults(logits_BTV: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool on the logits' device: True where :func:`check_logits` would raise (no host read)."""
    return (~torch.isfinite(logits_BTV.amax(dim=-1))).any()


def proposal_faults(proposal: Proposal, *, vocab_size: int) -> torch.Tensor:
    """A 0-dim bool on the proposal's device: True where the value checks of :func:`check_proposal`
    would raise (ids outside ``[0, V)``, probabilities not finite, negative or unnormalised); its
    shapes and dtypes are checked on the host first (``check_proposal(..., values=False)``)."""
    tokens = proposal.tokens_BK
    parts = [_ids_bad(tokens, vocab_size)]
    if proposal.probs_BKV is not None:
        parts.append(_probs_bad(proposal.probs_BKV, slice(None)))
    tree = proposal.tree
    if tree is not None:
        parts.append(_ids_bad(tree.tokens_BN[:, 1:], vocab_size))
        if tree.draft_probs_BNV is not None:
            parents = [i for i in range(tree.tree.num_nodes) if tree.tree.children[i]]
            parts.append(_probs_bad(tree.draft_probs_BNV, parents))
    device = tokens.device
    return torch.stack([p.to(device) for p in parts]).any()


def _ids_bad(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return ((ids < 0) | (ids >= vocab_size)).any()


def _probs_bad(probs: torch.Tensor, rows: slice | list) -> torch.Tensor:
    if probs.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=probs.device)
    values_bad = (~torch.isfinite(probs) | (probs < 0)).any()
    sums = probs[:, rows].double().sum(dim=-1)
    return values_bad | ((sums - 1.0).abs() > PROB_SUM_ATOL).any()


def _check_ids(
    name: str, ids: torch.Tensor, shape: tuple[int, ...], vocab_size: int, where: str, values: bool = True
) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dtype not in _INT_DTYPES:
        got = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"{where}: {name} must be an integer tensor, got {got}")
    if tuple(ids.shape) != shape:
        raise ValueError(f"{where}: {name} must have shape {list(shape)}, got {list(ids.shape)}")
    if values and ids.numel():
        low, high = torch.aminmax(ids)
        if int(low) < 0 or int(high) >= vocab_size:
            bad = ((ids < 0) | (ids >= vocab_size)).nonzero()[0].tolist()
            raise ValueError(
                f"{where}: {name} must hold token ids in [0, V={vocab_size}); row {bad[0]} holds "
                f"{int(ids[tuple(bad)])}"
            )


def _check_probs(
    name: str,
    probs: torch.Tensor,
    shape: tuple[int, ...],
    where: str,
    rows: slice | list,
    values: bool = True,
) -> None:
    """Finite, non-negative everywhere; normalised (to ``PROB_SUM_ATOL``) at positions ``rows``."""
    if not isinstance(probs, torch.Tensor) or not probs.is_floating_point():
        got = probs.dtype if isinstance(probs, torch.Tensor) else type(probs).__name__
        raise ValueError(f"{where}: {name} must be a floating-point tensor or None, got {got}")
    if tuple(probs.shape) != shape:
        raise ValueError(f"{where}: {name} must have shape {list(shape)}, got {list(probs.shape)}")
    if not values or probs.numel() == 0:
        return
    if probs.device.type == "cpu" and probs.dtype == torch.float32:  # single-threaded, as in check_logits
        arr = probs.detach().numpy()
        sums_np = arr[:, rows].sum(axis=-1, dtype=np.float64)
        if (
            arr.min() >= 0.0
            and np.isfinite(arr.max())
            and bool((np.abs(sums_np - 1.0) <= PROB_SUM_ATOL).all())
        ):
            return
    low, high = torch.aminmax(probs)  # NaN propagates into both
    if not (float(low) >= 0.0 and float(high) < float("inf")):
        bad = (~torch.isfinite(probs) | (probs < 0)).nonzero()[0].tolist()
        raise ValueError(
            f"{where}: {name} must be finite and non-negative; row {bad[0]}, position {bad[1]} holds "
            f"{float(probs[tuple(bad)]):.4g}"
        )
    sums = probs[:, rows].double().sum(dim=-1)
    off = (sums - 1.0).abs() > PROB_SUM_ATOL
    if bool(off.any()):
        b, k = off.nonzero()[0].tolist()
        raise ValueError(
            f"{where}: {name} must be normalised over the vocabulary; row {b}, position {k} sums to "
            f"{float(sums[b, k]):.6g} (tolerance {PROB_SUM_ATOL})"
        )


def check_proposal(
    proposal: Proposal,
    *,
    batch_size: int,
    gamma: int,
    vocab_size: int,
    step: int,
    source: str,
    values: bool = True,
) -> None:
    """``ValueError`` naming the step, the drafter and the row unless ``proposal`` is well formed:

    - ``tokens_BK``: an integer ``[B, K]`` tensor, ``K <= gamma``, ids in ``[0, V)``;
    - ``probs_BKV``: None or a float ``[B, K, V]`` tensor, finite, non-negative, rows summing to 1;
    - ``tree`` (a :class:`specdec.verify.token_tree.TreeProposal`): depth ``<= gamma``, ``tokens_BN`` integer
      ``[B, N]`` with ids in ``[0, V)`` below the root, ``draft_probs_BNV`` None or float
      ``[B, N, V]``, finite and non-negative, normalised at every node that has children.

    ``values=False`` checks types, dtypes and shapes only (no host read of the values: on an
    accelerator the engine checks them with :func:`proposal_faults`).
    """
    where = f"step {step}: drafter {source}"
    if not isinstance(proposal, Proposal):
        raise ValueError(f"{where}: propose() must return a specdec.Proposal, got {type(proposal).__name__}")
    tokens = proposal.tokens_BK
    if not isinstance(tokens, torch.Tensor) or tokens.ndim != 2:
        got = list(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise ValueError(f"{where}: tokens_BK must be a [B={batch_size}, K<={gamma}] tensor, got {got}")
    K = tokens.shape[1]
    if K > gamma:
        raise ValueError(f"{where}: proposed K={K} tokens, more than the gamma={gamma} asked for")
    _check_ids("tokens_BK", tokens, (batch_size, K), vocab_size, where, values)
    if proposal.probs_BKV is not None:
        _check_probs("probs_BKV", proposal.probs_BKV, (batch_size, K, vocab_size), where, slice(None), values)
    if proposal.tree is not None:
        _check_tree(proposal.tree, batch_size, gamma, vocab_size, where, values)


def _check_tree(
    tree_proposal, batch_size: int, gamma: int, vocab_size: int, where: str, values: bool = True
) -> None:
    from specdec.verify.token_tree import TreeProposal

    if not isinstance(tree_proposal, TreeProposal):
        raise ValueError(
            f"{where}: Proposal.tree must be a specdec.verify.token_tree.TreeProposal, "
            f"got {type(tree_proposal)}"
        )
    tree = tree_proposal.tree
    if tree.max_depth > gamma:
        raise ValueError(f"{where}: proposed a tree of depth {tree.max_depth}, deeper than gamma={gamma}")
    N = tree.num_nodes
    tokens_BN = tree_proposal.tokens_BN
    if not isinstance(tokens_BN, torch.Tensor) or tuple(tokens_BN.shape) != (batch_size, N):
        got = list(tokens_BN.shape) if isinstance(tokens_BN, torch.Tensor) else type(tokens_BN).__name__
        raise ValueError(f"{where}: tree tokens_BN must be a [B={batch_size}, N={N}] tensor, got {got}")
    _check_ids("tree tokens_BN", tokens_BN[:, 1:], (batch_size, N - 1), vocab_size, where, values)
    if tree_proposal.draft_probs_BNV is not None:
        parents = [i for i in range(N) if tree.children[i]]
        _check_probs(
            "tree draft_probs_BNV",
            tree_proposal.draft_probs_BNV,
            (batch_size, N, vocab_size),
            where,
            parents,
            values,
        )
