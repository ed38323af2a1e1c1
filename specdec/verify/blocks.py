"""Verify blocks: one interface for what the target runs for a proposal, chain or tree.

Legend: B batch, K draft length, N tree nodes (node 0 is the root), T block length, A committed
path length (accepted tokens + 1), V vocabulary, D hidden size.

Every engine step (:mod:`specdec.engine.runner`) goes the same way through a block:

1. ``tokens_BT(root_B)`` and ``forward_kwargs``: the block the target runs at slots
   ``lengths_B - 1 ...`` (a chain ``[root, d_1..d_K]``, or a tree's nodes with its ancestor mask
   and depths);
2. ``verify(rule, logits_BTV, ...)``: the verification rule's :class:`Verdict`, the committed
   tokens per row (the block only calls the rule: :func:`specdec.verify.registry.verify_chain` /
   :func:`~specdec.verify.registry.verify_tree`; greedy shortcuts and tree policies are the rule's);
3. ``settle(target, out, verdict, start_B, lengths_B)``: the cache made to read like the committed
   text (a chain needs nothing; a tree's accepted path is compacted into chain order) and rolled
   back to ``lengths_B - 1``; returns the verify output along the committed path, which the
   drafter observes.

``num_drafted`` counts the draft tokens the target verified (K, or the tree's N − 1 nodes): the
block costs ``num_drafted + 1`` target positions either way. ``depth`` is the most tokens a row can
accept (K, or the tree's depth).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch

from specdec.protocols import Proposal, TargetOutput, TreeTarget
from specdec.sampling import SamplingParams
from specdec.verify.contract import VerifyRule
from specdec.verify.registry import verify_chain, verify_tree
from specdec.verify.token_tree import TreeProposal

__all__ = ["Verdict", "ChainBlock", "TreeBlock", "make_block"]


class Verdict(NamedTuple):
    """``tokens_BA``: per row the accepted drafts, then one recovered or bonus token, then −1;
    ``num_accepted_B``; ``path_BA``: the block position of each committed token's *input* (the
    root, then the accepted nodes), or None for a chain (positions 0..A−1)."""

    tokens_BA: torch.Tensor
    num_accepted_B: torch.Tensor
    path_BA: torch.Tensor | None = None


@dataclass
class ChainBlock:
    """A chain proposal ``[root, d_1 .. d_K]``, verified by the rule (:func:`verify_chain`: its greedy
    fast path if it offers one, else its ``__call__``)."""

    draft_tokens_BK: torch.Tensor
    draft_probs_BKV: torch.Tensor | None

    @property
    def num_drafted(self) -> int:
        return self.draft_tokens_BK.shape[1]

    @property
    def depth(self) -> int:
        return self.num_drafted

    def tokens_BT(self, root_B: torch.Tensor) -> torch.Tensor:
        return torch.cat([root_B.unsqueeze(1), self.draft_tokens_BK.to(root_B)], dim=1)

    def forward_kwargs(self, device: Any) -> dict[str, torch.Tensor]:
        return {}

    def verify(
        self,
        rule: VerifyRule,
        logits_BTV: torch.Tensor,
        sampling: SamplingParams,
        **rule_kwargs: Any,
    ) -> Verdict:
        result = verify_chain(
            rule,
            logits_BTV,
            self.draft_tokens_BK.to(logits_BTV.device),
            _to(self.draft_probs_BKV, logits_BTV.device),
            sampling=sampling,
            validate=False,  # the engine checked the proposal (specdec.checks) and the logits
            **rule_kwargs,
        )
        return Verdict(result.tokens, result.num_accepted)

    def verify_greedy(self, rule: VerifyRule, logits_BTV: torch.Tensor) -> Verdict | None:
        """A greedy run's verdict from the rule's ``verify_greedy`` fast path, or None where the
        rule has none or it does not answer (then :meth:`verify`, with the rule's arguments)."""
        fast = getattr(rule, "verify_greedy", None)
        if not callable(fast):
            return None
        draft_BK = self.draft_tokens_BK.to(logits_BTV.device)
        result = fast(logits_BTV, draft_BK, _to(self.draft_probs_BKV, logits_BTV.device))
        return None if result is None else Verdict(result.tokens, result.num_accepted)

    def settle(
        self,
        target: Any,
        out: TargetOutput,
        verdict: Verdict,
        start_B: torch.Tensor,
        lengths_B: torch.Tensor,
        rows_B: torch.Tensor | None = None,
    ) -> TargetOutput:
        target.rollback(lengths_B - 1, **_rows(rows_B))
        return out


@dataclass
class TreeBlock:
    """A token tree (SpecInfer, arXiv 2305.09781), verified by the rule's tree policy (``verify_tree``;
    :func:`verify_tree` refuses a rule without one)."""

    proposal: TreeProposal

    @property
    def num_drafted(self) -> int:
        return self.proposal.tree.num_nodes - 1

    @property
    def depth(self) -> int:
        return self.proposal.tree.max_depth

    def tokens_BT(self, root_B: torch.Tensor) -> torch.Tensor:
        tokens_BN = self.proposal.tokens_BN.to(root_B).clone()
        tokens_BN[:, 0] = root_B
        return tokens_BN

    def forward_kwargs(self, device: Any) -> dict[str, torch.Tensor]:
        tree = self.proposal.tree
        return {"tree_mask_TT": tree.ancestor_mask(device), "depth_T": tree.depth_tensor(device)}

    def verify(
        self,
        rule: VerifyRule,
        logits_BTV: torch.Tensor,
        sampling: SamplingParams,
        **rule_kwargs: Any,
    ) -> Verdict:
        device = logits_BTV.device
        p = self.proposal
        if p.tokens_BN.device != device:  # drafts from the host, verified where the logits are
            p = replace(p, tokens_BN=p.tokens_BN.to(device), draft_probs_BNV=_to(p.draft_probs_BNV, device))
        result = verify_tree(rule, logits_BTV, p, sampling=sampling, **rule_kwargs)
        num_accepted_B = result.num_accepted.to(device)
        # The root and the accepted nodes, in path order; past a row's acceptance, repeat its last
        # accepted node (what lands there is beyond the row's new length: stale, never read).
        path_BA = torch.cat(
            [torch.zeros_like(result.path_nodes[:, :1]), result.path_nodes[:, :-1]], dim=1
        ).to(device)
        last_B1 = path_BA.gather(1, num_accepted_B.unsqueeze(1))
        keep_BA = torch.arange(path_BA.shape[1], device=device) <= num_accepted_B.unsqueeze(1)
        return Verdict(result.tokens.to(device), num_accepted_B, torch.where(keep_BA, path_BA, last_B1))

    def settle(
        self,
        target: Any,
        out: TargetOutput,
        verdict: Verdict,
        start_B: torch.Tensor,
        lengths_B: torch.Tensor,
        rows_B: torch.Tensor | None = None,
    ) -> TargetOutput:
        path_BA = verdict.path_BA
        target.copy_slots(start_B.unsqueeze(1) + path_BA[:, 1:], start_B + 1, **_rows(rows_B))
        target.rollback(lengths_B - 1, **_rows(rows_B))

        def on_path(h_BND: torch.Tensor) -> torch.Tensor:
            index = path_BA.to(h_BND.device).unsqueeze(-1).expand(-1, -1, h_BND.shape[-1])
            return h_BND.gather(1, index)

        return TargetOutput(
            logits_BTV=on_path(out.logits_BTV),
            hidden_BTD=None if out.hidden_BTD is None else on_path(out.hidden_BTD),
            aux_hidden_BTD=None
            if not out.aux_hidden_BTD
            else {i: on_path(h) for i, h in out.aux_hidden_BTD.items()},
        )


def _to(t: torch.Tensor | None, device: Any) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def _rows(rows_B: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The ``rows_B`` keyword for a target call over some of its cache rows (the engine's slots);
    nothing for a call over every row, so targets without the slot API keep working."""
    return {} if rows_B is None else {"rows_B": rows_B}


def make_block(proposal: Proposal, target: Any) -> ChainBlock | TreeBlock:
    """The block for a (checked) proposal: its tree if it has one, else its chain."""
    if proposal.tree is None:
        return ChainBlock(proposal.tokens_BK, proposal.probs_BKV)
    if not isinstance(target, TreeTarget):
        raise ValueError(
            f"the drafter proposed a token tree, but the target {type(target).__name__} cannot verify "
            "trees (a TreeTarget needs tree attention in forward and copy_slots: the native Llama target)"
        )
    return TreeBlock(proposal.tree)
