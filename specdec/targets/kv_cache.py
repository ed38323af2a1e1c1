"""A static, preallocated KV cache indexed by slot, with O(1) rollback (as in gpt-fast).

Legend: N layers (num_layers), B batch, H key/value heads, L slot capacity (max_len), D head dim,
T block length, S attended slots.

Row b's token at sequence position p lives in slot p of every layer. A block of T tokens for row b
is written at slots ``start_B[b] .. start_B[b]+T-1`` *before* it attends, so stale entries left by
rejected drafts past a row's length are overwritten before anyone can read them: rolling back is
just lowering ``lengths_B``, which lives on the host (the owner's bookkeeping: reading it is no
device synchronisation); the keys, values and every index the cache builds (rows, slots) live on the
cache's device. Tree verification writes a whole tree into consecutive slots and then
:meth:`StaticKVCache.copy_slots` compacts the accepted path (a gather and a scatter per call, for
all layers at once).
"""

from __future__ import annotations

import torch

__all__ = ["StaticKVCache", "block_attention_mask"]


class StaticKVCache:
    """Keys and values of every layer: ``k_NBHLD`` / ``v_NBHLD`` preallocated at construction."""

    def __init__(
        self,
        *,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, batch_size, num_kv_heads, max_len, head_dim)
        self.k_NBHLD = torch.zeros(shape, dtype=dtype, device=device)
        self.v_NBHLD = torch.zeros(shape, dtype=dtype, device=device)
        self.batch_size = batch_size
        self.max_len = max_len
        self.lengths_B = torch.zeros(batch_size, dtype=torch.long)
        self._rows_B1 = torch.arange(batch_size, device=device)[:, None]

    def write(
        self,
        layer: int,
        k_BTHD: torch.Tensor,
        v_BTHD: torch.Tensor,
        start_B: torch.Tensor,
        uniform_start: int | None,
        rows_B: torch.Tensor | None = None,
    ) -> None:
        """Store a block's keys/values at slots ``start_B[b] + arange(T)`` of ``layer``.

        ``uniform_start`` is the common start when every row starts at the same slot (one slice
        copy instead of an indexed scatter), else None. ``rows_B``: the cache row of each block row
        (a subset of the cache's rows); None: block row b is cache row b, every row. ``start_B`` and
        ``rows_B`` are expected on the cache's device (the slots are built there).
        """
        T = k_BTHD.shape[1]
        k_BHLD, v_BHLD = self.k_NBHLD[layer], self.v_NBHLD[layer]
        if rows_B is not None:
            slots_BT = start_B[:, None] + torch.arange(T, device=start_B.device)
            rows_B1 = rows_B.to(k_BHLD.device)[:, None]
            k_BHLD[rows_B1, :, slots_BT] = k_BTHD
            v_BHLD[rows_B1, :, slots_BT] = v_BTHD
        elif uniform_start is not None:
            k_BHLD[:, :, uniform_start : uniform_start + T] = k_BTHD.transpose(1, 2)
            v_BHLD[:, :, uniform_start : uniform_start + T] = v_BTHD.transpose(1, 2)
        else:
            slots_BT = start_B[:, None] + torch.arange(T, device=start_B.device)
            # Advanced indices (rows, slots) around a slice put [B, T] first: [B, T, H, D].
            k_BHLD[self._rows_B1, :, slots_BT] = k_BTHD
            v_BHLD[self._rows_B1, :, slots_BT] = v_BTHD

    def copy_slots(
        self, src_slots_BK: torch.Tensor, dst_start_B: torch.Tensor, rows_B: torch.Tensor | None = None
    ) -> None:
        """Move the keys/values at slots ``src_slots_BK[b]`` to slots ``dst_start_B[b] + arange(K)``.

        Every layer at once; the source is gathered before anything is written, so the ranges may
        overlap. Lengths are not changed: declare the new length with ``rollback`` afterwards.
        ``rows_B``: the cache rows of the B rows (default: every row, in order).
        """
        K = src_slots_BK.shape[1]
        if K == 0:
            return
        rows_B1 = self._rows_B1 if rows_B is None else rows_B.to(self.k_NBHLD.device)[:, None]
        dst_BK = dst_start_B[:, None] + torch.arange(K, device=dst_start_B.device)
        for cache in (self.k_NBHLD, self.v_NBHLD):
            gathered_BKNHD = cache[:, rows_B1, :, src_slots_BK]
            cache[:, rows_B1, :, dst_BK] = gathered_BKNHD


def block_attention_mask(start_B: torch.Tensor, num_slots: int, block_mask_TT: torch.Tensor) -> torch.Tensor:
    """Boolean mask ``[B, 1, T, S]`` (True = attend) for a block written at ``start_B[b] + arange(T)``.

    Block token i of row b sees every slot before ``start_B[b]`` and block slot ``start_B[b] + j``
    when ``block_mask_TT[i, j]`` (causal: lower triangle; tree: ancestors and itself). Slots past
    the block are never seen.
    """
    T = block_mask_TT.shape[0]
    rel_BS = torch.arange(num_slots, device=start_B.device)[None, :] - start_B[:, None]
    in_block_BS = (rel_BS >= 0) & (rel_BS < T)
    block_BTS = block_mask_TT[:, rel_BS.clamp(0, T - 1)].permute(1, 0, 2) & in_block_BS[:, None, :]
    return ((rel_BS < 0)[:, None, :] | block_BTS)[:, None]
