"""The draft head's static KV cache, and one head step over a block of (feature, token) pairs.

Legend: B batch, T block length, D hidden size, H query heads, G key/value heads, d head dim,
L cache capacity (slots).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.drafters.eagle.model import EagleHead
from specdec.drafters.eagle.packed import PackedEagleHead

__all__ = ["EagleCache"]


class EagleCache:
    """The head's keys and values: slot s of row b holds the pair whose feature is at position s.

    Rows are independent; a block writes its slots, then attends to the slots its ``visible``
    mask allows (slots past a row's valid length may hold stale drafts and are never visible).
    """

    def __init__(self, head: EagleHead | PackedEagleHead, batch_size: int, capacity: int) -> None:
        c = head.config
        shape = (batch_size, c.num_kv_heads, capacity, c.head_dim)
        self.k_BGLd = torch.zeros(shape, dtype=torch.float32, device=head.embed_VD.device)
        self.v_BGLd = torch.zeros_like(self.k_BGLd)

    def row(self, b: int) -> EagleCache:
        """Row ``b`` as a cache of one row whose keys and values are views of this one's: what a step
        on it writes lands in row ``b`` (until it grows; :meth:`ensure` this cache first)."""
        view = EagleCache.__new__(EagleCache)
        view.k_BGLd, view.v_BGLd = self.k_BGLd[b : b + 1], self.v_BGLd[b : b + 1]
        return view

    @property
    def capacity(self) -> int:
        return self.k_BGLd.shape[2]

    def ensure(self, capacity: int) -> None:
        """Grow (by doubling) so that ``capacity`` slots fit."""
        if capacity <= self.capacity:
            return
        pad = (0, 0, 0, max(capacity, 2 * self.capacity) - self.capacity)
        self.k_BGLd, self.v_BGLd = F.pad(self.k_BGLd, pad), F.pad(self.v_BGLd, pad)

    def step(
        self,
        head: EagleHead | PackedEagleHead,
        feature_BTD: torch.Tensor,
        tokens_BT: torch.Tensor,
        slots_BT: torch.Tensor,
        positions_BT: torch.Tensor,
        visible_BTL: torch.Tensor | None,
        prev_tokens_BT: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the head on a block of pairs at cache ``slots_BT`` (RoPE at ``positions_BT``); returns
        the predicted features ``[B, T, D]``.

        ``visible_BTL[b, t, s]``: may query t attend to slot s (``L`` = slots in use). ``None``: one
        query per row at the same slot, which sees every slot up to its own (no mask).
        ``prev_tokens_BT``: the tokens at the features' positions (a ``prev_token_input`` head).
        """
        B, T = tokens_BT.shape
        slots_used = int(slots_BT.max()) + 1
        L = slots_used if visible_BTL is None else visible_BTL.shape[-1]
        self.ensure(slots_used)
        h_BTD = head.fuse(feature_BTD, tokens_BT, prev_tokens_BT)
        q, k, v = head.qkv(h_BTD, positions_BT)
        s = int(slots_BT[0, 0])
        # one row writing consecutive slots (every chain draft step and catch-up): a plain copy
        if B == 1 and (T == 1 or bool((slots_BT[0] == torch.arange(s, s + T, device=slots_BT.device)).all())):
            self.k_BGLd[:, :, s : s + T] = k
            self.v_BGLd[:, :, s : s + T] = v
        else:
            rows_BT = torch.arange(B, device=slots_BT.device).unsqueeze(1).expand(B, T)
            self.k_BGLd[rows_BT, :, slots_BT] = k.transpose(1, 2)
            self.v_BGLd[rows_BT, :, slots_BT] = v.transpose(1, 2)
        # Grouped-query attention without repeating keys: the query heads of one key/value head
        # are stacked as rows (row r·T + t), as in the native target.
        c = head.config
        H, G, d = c.num_heads, c.num_kv_heads, c.head_dim
        mask = None if visible_BTL is None else visible_BTL.unsqueeze(1).repeat(1, 1, H // G, 1)
        attn = F.scaled_dot_product_attention(
            q.reshape(B, G, (H // G) * T, d), self.k_BGLd[:, :, :L], self.v_BGLd[:, :, :L], attn_mask=mask
        )
        return head.feature(head.finish(h_BTD, attn.reshape(B, H, T, d)))
