"""The native target's fast CPU path: a block through the whole decoder in one C call
(``kernels.llama_forward``), and a longer chain block in consecutive chunks of ``MAX_BLOCK``.

Legend: B batch, T block length, M = B·T token rows, D model dim.

The native forward is block-length invariant: a token's output is the same whatever block it comes
in, so a chain block longer than ``MAX_BLOCK`` (a prompt's prefill) runs chunk by chunk, each chunk
reading the previous chunks' keys and values from the cache, as a causal block does. It computes in
float32: the embedding's rows are read as float32 whatever the table is stored in.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.llama_forward import MAX_BLOCK, NativeDecoder
from specdec.targets.kv_cache import StaticKVCache

__all__ = ["run_native"]


def run_native(
    native: NativeDecoder,
    cache: StaticKVCache,
    embed_VD: torch.Tensor,
    cos_PE: torch.Tensor,
    sin_PE: torch.Tensor,
    tokens_BT: torch.Tensor,
    start_B: torch.Tensor,
    layers: Sequence[int],
    tree_mask_TT: torch.Tensor | None,
    depth_T: torch.Tensor | None,
    capture: Sequence[int],
    aux_out: dict[int, torch.Tensor] | None,
    rows_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """A block through ``layers``: up to ``MAX_BLOCK`` tokens in one call, a longer chain block (no
    tree mask, no depths) in consecutive chunks of ``MAX_BLOCK``; returns the last layer's output
    ``[B, T, D]`` and puts the outputs of the ``capture`` layers into ``aux_out``.

    ``cos_PE`` / ``sin_PE``: the rope tables by position (``sin`` flipped); ``start_B`` on the host."""
    B, T = tokens_BT.shape
    if T > MAX_BLOCK:
        if tree_mask_TT is not None or depth_T is not None:
            raise ValueError(f"a token tree of {T} nodes exceeds the native block of {MAX_BLOCK} tokens")
        outs, chunk_aux = [], []
        for s in range(0, T, MAX_BLOCK):
            part_aux: dict[int, torch.Tensor] | None = None if aux_out is None else {}
            piece_BT = tokens_BT[:, s : s + MAX_BLOCK]
            chunk = (piece_BT, start_B + s, layers, None, None, capture, part_aux, rows_B)
            outs.append(run_native(native, cache, embed_VD, cos_PE, sin_PE, *chunk))
            chunk_aux.append(part_aux)
        if aux_out is not None:
            for i in chunk_aux[0]:
                aux_out[i] = torch.cat([a[i] for a in chunk_aux], dim=1)
        return torch.cat(outs, dim=1)
    offsets_T = torch.arange(T) if depth_T is None else depth_T.to(torch.long).cpu()
    positions_M = (start_B[:, None] + offsets_T[None, :]).reshape(-1)
    x_MD = embed_VD[tokens_BT.reshape(-1)].to(torch.float32).contiguous()  # written in place
    outs = native.forward(
        x_MD,
        start_B,
        cos_PE[positions_M],
        sin_PE[positions_M],
        cache.k_NBHLD,
        cache.v_NBHLD,
        tree_mask_TT,
        list(layers),
        list(capture),
        rows_B,
    )
    for i, out in zip(capture, outs, strict=True):
        aux_out[i] = out.view(B, T, -1)
    return x_MD.view(B, T, -1)
