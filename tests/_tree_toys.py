"""Toy models for token-tree tests: a tree-attention Markov target, a Markov tree drafter, and the
exact law of one tree verification step computed independently of ``specdec.verify.tree``.

Legend: B batch, T block length, N tree nodes, O Markov order, V vocabulary.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch

from specdec.protocols import DecodeState, Proposal, TargetOutput
from specdec.sampling import logits_to_probs
from specdec.testing import MarkovModel, MarkovTarget, keyed_randomness
from specdec.verify.noise import sample_keyed
from specdec.verify.token_tree import TokenTree, TreeProposal


class TreeMarkovTarget(MarkovTarget):
    """A :class:`MarkovTarget` that also takes ``tree_mask_TT`` / ``depth_T`` and has ``copy_slots``:
    block token i's context is the prefix followed by its ancestors (from the mask) and itself."""

    def forward(
        self, tokens_BT, start_B, *, rows_B=None, logits_index_BN=None, tree_mask_TT=None, depth_T=None
    ):
        if tree_mask_TT is None:
            return super().forward(tokens_BT, start_B, rows_B=rows_B, logits_index_BN=logits_index_BN)
        B, T = tokens_BT.shape
        O, V = self.model.order, self.vocab_size
        rows = self._rows(rows_B, B)
        slots_BL = self._slots_BL[rows]
        start_B = start_B.long().cpu()
        if (start_B > self._valid_B[rows]).any():
            raise RuntimeError("protocol violation: block past the cached length")
        pos_BT = start_B.unsqueeze(1) + torch.arange(T)
        slots_BL.scatter_(1, pos_BT, tokens_BT.long().cpu())
        self._slots_BL[rows] = slots_BL
        self._valid_B[rows] = start_B + T
        # Relative slots of each token's last O context tokens: prefix (negative) then ancestors.
        offsets = []
        for i in range(T):
            chain = [j for j in range(T) if tree_mask_TT[i, j]]
            if depth_T is not None and len(chain) != int(depth_T[i]) + 1:
                raise RuntimeError("depth_T disagrees with the ancestor mask")
            offsets.append(([-k for k in range(O, 0, -1)] + chain)[-O:])
        ctx_pos_BTO = start_B.view(B, 1, 1) + torch.tensor(offsets).view(1, T, O)
        ctx_BTO = slots_BL.gather(1, ctx_pos_BTO.clamp(min=0).reshape(B, -1)).reshape(B, T, O)
        ctx_BTO = torch.where(ctx_pos_BTO >= 0, ctx_BTO, V)
        return TargetOutput(logits_BTV=self.model.logits_for(ctx_BTO), hidden_BTD=None)

    def copy_slots(self, src_slots_BN: torch.Tensor, dst_start_B: torch.Tensor, rows_B=None) -> None:
        src = src_slots_BN.long().cpu()
        rows = self._rows(rows_B, src.shape[0])
        slots_BL = self._slots_BL[rows]
        dst = dst_start_B.long().cpu().unsqueeze(1) + torch.arange(src.shape[1])
        slots_BL.scatter_(1, dst, slots_BL.gather(1, src))
        self._slots_BL[rows] = slots_BL


class TreeMarkovDrafter:
    """Drafts a fixed-shape tree from a :class:`MarkovModel`; children drawn ``mode``:
    ``"without"`` (Gumbel-top-k), ``"with"`` (i.i.d.), ``"top"`` (deterministic top-k) or ``"second"``.
    ``verify_replacement`` overrides what the proposal tells the verifier (to plant a bug).
    Stateless (``batched_rows``): given ``noise`` it draws keyed by each row's seed, output position
    and node (stream ``"draft"``), so a row's tree never depends on the rows beside it."""

    batched_rows = True

    def __init__(
        self,
        model: MarkovModel,
        tree: TokenTree,
        *,
        mode: str = "without",
        verify_replacement: bool | None = None,
    ) -> None:
        self.model, self.tree, self.mode = model, tree, mode
        self.verify_replacement = (mode == "with") if verify_replacement is None else verify_replacement

    def begin(self, state: DecodeState, target_out: TargetOutput) -> None:
        pass

    def observe(self, state: DecodeState, num_accepted_B, target_out: TargetOutput) -> None:
        pass

    def propose(self, state: DecodeState, gamma: int, generator=None, *, noise=None) -> Proposal:
        room = int(state.tokens_BL.shape[1] - (state.lengths_B.max() - 1))
        tree = self.tree.truncate(gamma, room)
        B, N, O, V = state.batch_size, tree.num_nodes, self.model.order, self.model.vocab_size
        index_BO = state.lengths_B.unsqueeze(1) - O + torch.arange(O)
        ctx = {0: torch.where(index_BO >= 0, state.tokens_BL.gather(1, index_BO.clamp(min=0)), V)}
        tokens_BN = torch.zeros(B, N, dtype=torch.long)
        draft_BNV = torch.zeros(B, N, V)
        s = state.sampling
        for node in range(N):
            kids = list(tree.children[node])
            if not kids:
                continue
            q_BV = logits_to_probs(self.model.logits_for(ctx[node]), s.temperature, s.top_k, s.top_p)
            draft_BNV[:, node] = q_BV
            keys = None
            if noise is not None:  # a key per (row, output position, node): _KEYS_PER_POSITION slots
                keys = (state.lengths_B - state.prompt_lengths_B) * _KEYS_PER_POSITION + node * _MAX_CHILDREN
            picks = draw_children(q_BV, len(kids), self.mode, generator, noise=noise, keys_B=keys)
            tokens_BN[:, kids] = picks
            for j, c in enumerate(kids):
                ctx[c] = torch.cat([ctx[node][:, 1:], picks[:, j : j + 1]], dim=1)
        main = list(tree.main_path)
        point_mass = self.mode in ("top", "second")
        probs = None if point_mass else draft_BNV[:, [tree.parents[c] for c in main]]
        return Proposal(
            tokens_BN[:, main],
            probs,
            tree=TreeProposal(
                tree, tokens_BN, None if point_mass else draft_BNV, replacement=self.verify_replacement
            ),
        )


_MAX_CHILDREN = 16
_KEYS_PER_POSITION = 1024 * _MAX_CHILDREN  # nodes x children: keyed draws of one output position


def tree_randomness(generator: torch.Generator | None, tree: TokenTree, B: int) -> dict:
    """Keyed randomness for a tree verify call: each row's seed from ``generator``, node i at
    position depth(i) (``tree_rejection_sample(..., **tree_randomness(g, tree, B))``)."""
    keyed = keyed_randomness(generator, tree.depth_tensor().expand(B, -1))
    return {"noise": keyed["noise"], "positions_BN": keyed["positions_BK"]}


def draw_children(
    q_BV: torch.Tensor, k: int, mode: str, generator=None, *, noise=None, keys_B=None
) -> torch.Tensor:
    """k candidates per row from ``q_BV``: without replacement, with replacement, top-k, or top-k
    with ranks 0 and 1 swapped (``"second"``: the best token is always the second candidate).
    With ``noise`` the draws are keyed at positions ``keys_B + j`` (j < k) of stream ``"draft"``."""
    if mode in ("top", "second"):
        order = torch.sort(q_BV, dim=-1, descending=True, stable=True).indices
        if mode == "second":
            order = order[:, [1, 0, *range(2, order.shape[1])]]
        return order[:, :k]
    if noise is not None:
        if mode == "with":
            keys_BK = keys_B.unsqueeze(1) + torch.arange(k)
            return sample_keyed(q_BV.unsqueeze(1).expand(-1, k, -1), noise, keys_BK, stream="draft")
        u = noise.uniform_BKV(keys_B.unsqueeze(1), q_BV.shape[-1], "draft")[:, 0].double()
        u = u.clamp_(1e-20, 1 - 1e-7)
        return (q_BV.log() - (-u.log()).log()).topk(k, dim=-1).indices
    if mode == "with":
        return torch.multinomial(q_BV, k, replacement=True, generator=generator)
    u = torch.rand(q_BV.shape, generator=generator).clamp_(1e-20, 1 - 1e-7)
    return (q_BV.log() - (-u.log()).log()).topk(k, dim=-1).indices


# --- exact law of one tree step (independent of specdec.verify.tree) ----------------------------------
def _draws(q: list[float], k: int, mode: str):
    """Ordered candidate tuples with their probabilities (None = an exhausted, always-rejected slot)."""
    V = len(q)
    if mode == "top":
        order = sorted(range(V), key=lambda x: (-q[x], x))
        yield tuple(order[:k]), 1.0
    elif mode == "with":
        for tup in itertools.product(range(V), repeat=k):
            pr = 1.0
            for x in tup:
                pr *= q[x]
            if pr > 0:
                yield tup, pr
    else:

        def rec(prefix, pr, left):
            if len(prefix) == k:
                yield tuple(prefix), pr
                return
            mass = sum(left)
            if mass <= 0:  # support exhausted: remaining candidates propose nothing
                yield tuple(prefix) + (None,) * (k - len(prefix)), pr
                return
            for x in range(V):
                if left[x] > 0:
                    nxt = list(left)
                    nxt[x] = 0.0
                    yield from rec(prefix + [x], pr * left[x] / mass, nxt)

        yield from rec([], 1.0, list(q))


def exact_step_law(
    target_fn: Callable[[tuple[int, ...]], list[float]],
    draft_fn: Callable[[tuple[int, ...]], list[float]],
    tree: TokenTree,
    context: Sequence[int],
    *,
    draw: str,
    rule: str,
) -> dict[tuple[int, ...], float]:
    """P(one tree step emits exactly this token tuple), enumerating every draw and coin.

    ``draw``: how children are drawn (without / with / top); ``rule``: the residual rule the
    verifier applies (without / with / point), to plant mismatches.
    """
    context = tuple(context)

    def node_law(node: int, path: tuple[int, ...]) -> dict:
        p0 = target_fn(context + path)
        kids = tree.children[node]
        out: dict = defaultdict(float)
        if not kids:
            for y, py in enumerate(p0):
                if py > 0:
                    out[(y,)] += py
            return out
        q0 = draft_fn(context + path)
        for cands, pr_draw in _draws(q0, len(kids), draw):
            p, q, reach = list(p0), list(q0), pr_draw
            for c, x in zip(kids, cands, strict=True):
                if x is None:
                    continue
                qx = 1.0 if rule == "point" else q[x]
                a = 0.0 if qx <= 0 else min(1.0, p[x] / qx)
                if a > 0:
                    for seq, pr in node_law(c, path + (x,)).items():
                        out[(x,) + seq] += reach * a * pr
                reach *= 1 - a
                if rule == "point":
                    res = [0.0 if i == x else pi for i, pi in enumerate(p)]
                else:
                    res = [max(pi - q[i], 0.0) for i, pi in enumerate(p)]
                if sum(res) > 0:
                    p = [r / sum(res) for r in res]
                if rule == "without":
                    q[x] = 0.0
                    q = [qi / sum(q) for qi in q] if sum(q) > 0 else [0.0] * len(q)
            for y, py in enumerate(p):
                if py > 0:
                    out[(y,)] += reach * py
        return out

    return dict(node_law(0, ()))


def complete(law: dict, target_fn, context: Sequence[int], length: int) -> dict[tuple[int, ...], float]:
    """Cut or extend every emitted tuple to ``length`` tokens with the target's own continuation."""
    out: dict = defaultdict(float)
    stack = [(seq[:length], pr) for seq, pr in law.items()]
    while stack:
        seq, pr = stack.pop()
        if len(seq) == length:
            out[seq] += pr
            continue
        for y, py in enumerate(target_fn(tuple(context) + seq)):
            if py > 0:
                stack.append((seq + (y,), pr * py))
    return dict(out)


def model_fn(model: MarkovModel, sampling) -> Callable[[tuple[int, ...]], list[float]]:
    return lambda ctx: model.next_token_probs([list(ctx)], sampling)[0].tolist()
