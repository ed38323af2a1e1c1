"""The verification-rule contract: what a rule is given, what it returns, and the input checks.

Legend: B batch, K draft length (γ), N tree nodes, V vocabulary.

A rule turns the target's and the drafter's distributions into committed tokens
(:class:`VerifyResult`: accepted drafts, then one recovered or bonus token). It is looked up by name
in :data:`specdec.verify.registry.VERIFY_RULES` and called by the engine's verify blocks
(:mod:`specdec.verify.blocks`) through :func:`specdec.verify.registry.verify_chain` and
:func:`~specdec.verify.registry.verify_tree`. The checks here run once, at the boundary
(``validate=True``); the walks trust their inputs.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from specdec.verify.noise import PositionNoise
from specdec.verify.token_tree import TreeProposal
from specdec.verify.tree import TreeVerifyResult

__all__ = [
    "VerifyResult",
    "VerifyRule",
    "GreedyVerifyRule",
    "TreeVerifyRule",
    "validate_verify_inputs",
    "validate_keyed_inputs",
    "need_noise",
]

# Tolerance on Σ probs = 1 (float32 sums over a 50k vocabulary are off by ~1e-5).
_NORM_ATOL = 1e-3


class VerifyResult(NamedTuple):
    """``tokens [B, K+1]``: accepted drafts, then one recovered or bonus token, then ``-1`` padding.
    ``num_accepted [B]``: how many draft tokens were accepted (0..K)."""

    tokens: torch.Tensor
    num_accepted: torch.Tensor


def _check_probs(name: str, probs: torch.Tensor) -> None:
    if not probs.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {probs.dtype}")
    if probs.numel() == 0:
        return
    if torch.isnan(probs).any():
        raise ValueError(f"{name} contains NaN")
    if (probs < 0).any():
        raise ValueError(f"{name} contains negative probabilities (min {probs.min().item():.3g})")
    sums = probs.double().sum(dim=-1)
    worst = (sums - 1.0).abs().max().item()
    if worst > _NORM_ATOL:
        raise ValueError(
            f"{name} must be normalised over the last (vocab) dim: a row sums to "
            f"{sums.flatten()[(sums - 1.0).abs().flatten().argmax()].item():.6g} (tolerance {_NORM_ATOL})"
        )


def validate_verify_inputs(
    target_probs_BKV: torch.Tensor,
    draft_tokens_BK: torch.Tensor,
    draft_probs_BKV: torch.Tensor | None,
) -> None:
    """Raise ``ValueError`` naming the argument when shapes, vocabularies or values are wrong."""
    if not isinstance(target_probs_BKV, torch.Tensor) or target_probs_BKV.ndim != 3:
        raise ValueError(
            "target_probs_BKV must be a tensor of shape [B, K+1, V], got "
            f"{getattr(target_probs_BKV, 'shape', type(target_probs_BKV).__name__)}"
        )
    if not isinstance(draft_tokens_BK, torch.Tensor) or draft_tokens_BK.ndim != 2:
        raise ValueError(
            "draft_tokens_BK must be a tensor of shape [B, K], got "
            f"{getattr(draft_tokens_BK, 'shape', type(draft_tokens_BK).__name__)}"
        )
    B, K1, V = target_probs_BKV.shape
    if draft_tokens_BK.shape[0] != B:
        raise ValueError(
            f"batch mismatch: draft_tokens_BK has B={draft_tokens_BK.shape[0]}, target_probs_BKV has B={B}"
        )
    K = draft_tokens_BK.shape[1]
    if K1 != K + 1:
        raise ValueError(
            f"draft length mismatch: target_probs_BKV must have K+1={K + 1} positions for K={K} draft "
            f"tokens, got {K1}"
        )
    if V < 1:
        raise ValueError("target_probs_BKV must have a vocab dim V >= 1")
    if draft_tokens_BK.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise ValueError(f"draft_tokens_BK must be an integer tensor, got dtype {draft_tokens_BK.dtype}")
    if draft_tokens_BK.device != target_probs_BKV.device:
        raise ValueError(
            f"draft_tokens_BK is on {draft_tokens_BK.device}, target_probs_BKV on {target_probs_BKV.device}"
        )
    if draft_tokens_BK.numel() and (int(draft_tokens_BK.min()) < 0 or int(draft_tokens_BK.max()) >= V):
        raise ValueError(
            f"draft_tokens_BK must lie in [0, V={V}), got values in "
            f"[{int(draft_tokens_BK.min())}, {int(draft_tokens_BK.max())}]"
        )
    _check_probs("target_probs_BKV", target_probs_BKV)
    if draft_probs_BKV is not None:
        if not isinstance(draft_probs_BKV, torch.Tensor) or draft_probs_BKV.ndim != 3:
            raise ValueError(
                "draft_probs_BKV must be None or a tensor of shape [B, K, V], got "
                f"{getattr(draft_probs_BKV, 'shape', type(draft_probs_BKV).__name__)}"
            )
        if draft_probs_BKV.shape[:2] != (B, K):
            raise ValueError(
                f"draft_probs_BKV must have shape [B={B}, K={K}, V], got {tuple(draft_probs_BKV.shape)}"
            )
        if draft_probs_BKV.shape[2] != V:
            raise ValueError(
                f"vocab mismatch: draft_probs_BKV has V={draft_probs_BKV.shape[2]}, "
                f"target_probs_BKV has V={V}"
            )
        if draft_probs_BKV.device != target_probs_BKV.device:
            raise ValueError(
                f"draft_probs_BKV is on {draft_probs_BKV.device}, target_probs_BKV on "
                f"{target_probs_BKV.device}"
            )
        _check_probs("draft_probs_BKV", draft_probs_BKV)


def validate_keyed_inputs(
    noise: PositionNoise, positions_BK: torch.Tensor, target_probs_BKV: torch.Tensor
) -> None:
    """Raise ``ValueError`` unless ``noise`` serves the B rows of ``target_probs_BKV [B, K1, V]`` on its
    device and ``positions_BK`` is an integer ``[B, K1]`` tensor of positions >= 0 on that device."""
    B, K1 = target_probs_BKV.shape[:2]
    if not isinstance(noise, PositionNoise):
        raise ValueError(f"noise must be a specdec.verify.noise.PositionNoise, got {type(noise).__name__}")
    if noise.num_rows != B:
        raise ValueError(f"noise has {noise.num_rows} rows (seeds), the batch has B={B}")
    if not isinstance(positions_BK, torch.Tensor) or tuple(positions_BK.shape) != (B, K1):
        raise ValueError(
            f"positions_BK must be a tensor [B={B}, {K1}]: the sequence position of the token each target "
            f"row decides, got {tuple(getattr(positions_BK, 'shape', ())) or type(positions_BK).__name__}"
        )
    if positions_BK.device != noise.device or noise.device != target_probs_BKV.device:
        raise ValueError(
            f"noise ({noise.device}), positions_BK ({positions_BK.device}) and the probabilities "
            f"({target_probs_BKV.device}) must be on one device"
        )
    noise.check_positions(positions_BK)


def need_noise(rule: str, noise: PositionNoise | None, positions: torch.Tensor | None) -> None:
    if noise is None or positions is None:
        raise ValueError(
            f"verification rule {rule!r} draws from public randomness keyed by seed and position: call it "
            "with noise= (a specdec.verify.noise.PositionNoise, one seed per row) and positions_BK= "
            "(the sequence position of the token each target row decides); greedy runs need neither"
        )


@runtime_checkable
class VerifyRule(Protocol):
    """Turns target and draft probabilities into committed tokens, like :func:`rejection_sample`.

    The one signature of a rule: the inputs and output of :func:`specdec.verify.rejection_sample`,
    plus the target's raw logits (``[B, K+1, V]``, before temperature / top-k / top-p), the run's
    sampling parameters, and the rows' public randomness: ``noise`` (one seed per row) and
    ``positions_BK`` (``[B, K+1]``, the sequence position of the token each target row decides).
    ``lossless`` says whether the output distribution is exactly the target's. A rule may also
    declare ``drafter_invariant = True`` (its output does not depend on the drafter: the engine may
    then choose draft depths from load and timings); absent means False. Greedy runs call
    ``__call__`` too, with one-hot target probabilities, unless the rule offers a fast path
    (:class:`GreedyVerifyRule`).
    """

    lossless: bool

    def __call__(
        self,
        target_probs_BKV: torch.Tensor,
        draft_tokens_BK: torch.Tensor,
        draft_probs_BKV: torch.Tensor | None,
        **context: Any,
    ) -> VerifyResult:
        """``context``: ``target_logits_BKV``, ``sampling``, ``noise``, ``positions_BK``, ``validate``
        (spelled out once, in :meth:`specdec.verify.rule.Rule.__call__`)."""
        ...


@runtime_checkable
class GreedyVerifyRule(VerifyRule, Protocol):
    """A rule with a fast path for greedy runs (temperature 0), called before any probabilities exist."""

    def verify_greedy(
        self,
        target_logits_BKV: torch.Tensor,
        draft_tokens_BK: torch.Tensor,
        draft_probs_BKV: torch.Tensor | None,
    ) -> VerifyResult | None:
        """The rule's greedy result from the raw target logits ``[B, K+1, V]``, or None: then the rule
        is called (``__call__``) with the one-hot target probabilities instead."""
        ...


@runtime_checkable
class TreeVerifyRule(VerifyRule, Protocol):
    """A rule that also verifies a token tree: ``verify_tree`` is its tree policy (``positions_BK``
    is then ``[B, N]``, per node). Exact rules use multi-candidate recursive rejection sampling
    (:mod:`specdec.verify.tree`); a lossy rule defines and documents its own (``lenient``)."""

    def verify_tree(
        self, target_logits_BNV: torch.Tensor, proposal: TreeProposal, **context: Any
    ) -> TreeVerifyResult:
        """The committed path of a tree whose node i's target logits are ``target_logits_BNV[:, i]``;
        ``context``: ``sampling``, ``noise``, ``positions_BK`` (``[B, N]``, per node)."""
        ...
