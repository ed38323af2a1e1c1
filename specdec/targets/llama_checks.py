"""The native target's argument checks: what :class:`specdec.targets.llama.LlamaTarget` checks at its
boundary, once per call, before anything reaches the cache or a kernel.

Legend: B batch, T block length, N selected positions (logits) or slots (copies).

Every check raises ``ValueError`` naming the argument and what was expected. Host-side bookkeeping
(the cache's lengths, the blocks' starts, the rows) is checked as Python lists: a few rows, where
each small torch op costs more than the loop. Index tensors handed in already on an accelerator
(``tree_mask_TT``, ``depth_T``, ``logits_index_BN``, copy slots) are trusted: checking their values
would read them back and synchronise every forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from specdec.checks import value_range
from specdec.targets.kv_cache import StaticKVCache
from specdec.targets.llama_config import LlamaConfig

__all__ = [
    "need_cache",
    "check_cache_shape",
    "check_rows",
    "check_block",
    "check_lengths",
    "check_copy",
    "check_layer_choice",
    "check_logits_index",
]


def need_cache(cache: StaticKVCache | None) -> StaticKVCache:
    """``cache``, or a ``ValueError`` when ``reset`` has not made one yet."""
    if cache is None:
        raise ValueError("call reset(batch_size, max_len) before using the target")
    return cache


def check_cache_shape(
    config: LlamaConfig, batch_size: int, max_len: int, max_context_length: int | None
) -> None:
    """``reset``'s arguments: positive ints, ``max_len`` within the context length and, for a model
    with a sliding window, within the window (sliding-window attention is not implemented)."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be an int >= 1, got {max_len!r}")
    limit = max_context_length
    if limit is not None and max_len > limit:
        raise ValueError(
            f"max_len={max_len} exceeds the model's context length max_context_length={limit} "
            "(max_position_embeddings)"
        )
    window = config.sliding_window
    if window is not None and max_len > window:
        raise ValueError(
            f"max_len={max_len} exceeds the model's sliding_window={window}; sliding-window attention "
            "is not implemented by the native target (use max_len <= sliding_window or the 'hf' backend)"
        )


def check_rows(cache: StaticKVCache | None, rows_B: Any, B: int) -> torch.Tensor:
    """``rows_B`` as a CPU long tensor of B distinct cache rows, or a ``ValueError``."""
    cache = need_cache(cache)
    rows = torch.as_tensor(rows_B, dtype=torch.long).reshape(-1).cpu()
    values = rows.tolist()
    if (
        len(values) != B
        or len(set(values)) != len(values)
        or any(not 0 <= r < cache.batch_size for r in values)
    ):
        raise ValueError(f"rows_B must hold {B} distinct cache rows in [0, {cache.batch_size}), got {values}")
    return rows


def check_block(
    cache: StaticKVCache | None,
    vocab_size: int,
    tokens_BT: Any,
    start_B: Any,
    tree_mask_TT: torch.Tensor | None,
    depth_T: torch.Tensor | None,
    *,
    check_length: bool = True,
    rows_B: Any = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A forward's block: ``(tokens_BT, start_B as a CPU long tensor, rows_B checked or None)``.

    Every block fits the cache (``start_B[b] + T <= max_len``); with ``check_length`` no block
    starts past its row's cached length (a gap); a tree mask is bool ``[T, T]`` with its diagonal, a
    depth is ``[T]`` and stays inside the cache; tokens lie in ``[0, vocab_size)``."""
    cache = need_cache(cache)
    if (
        not isinstance(tokens_BT, torch.Tensor)
        or tokens_BT.ndim != 2
        or tokens_BT.dtype not in (torch.long, torch.int32)
    ):
        raise ValueError(
            f"tokens_BT must be an integer tensor [B, T], got {getattr(tokens_BT, 'shape', tokens_BT)}"
        )
    B, T = tokens_BT.shape
    rows = None if rows_B is None else check_rows(cache, rows_B, B)
    if (rows is None and B != cache.batch_size) or T < 1:
        raise ValueError(f"tokens_BT must be [B={cache.batch_size}, T>=1], got {tuple(tokens_BT.shape)}")
    start_B = torch.as_tensor(start_B, dtype=torch.long).reshape(-1).cpu()
    if start_B.shape[0] != B:
        raise ValueError(f"start_B must have {B} entries, got {start_B.shape[0]}")
    starts = start_B.tolist()
    if any(s < 0 or s + T > cache.max_len for s in starts):
        raise ValueError(f"blocks must fit in [0, max_len={cache.max_len}); start_B={starts}, T={T}")
    held = cache.lengths_B.tolist()
    held = held if rows is None else [held[r] for r in rows.tolist()]
    if check_length and any(s > h for s, h in zip(starts, held, strict=True)):
        raise ValueError(f"start_B={starts} is past the cached lengths {held} (a gap)")
    if tree_mask_TT is not None:
        if tree_mask_TT.shape != (T, T) or tree_mask_TT.dtype != torch.bool:
            raise ValueError(
                f"tree_mask_TT must be a bool tensor [T={T}, T], got {tuple(tree_mask_TT.shape)}"
            )
        if tree_mask_TT.device.type == "cpu" and not tree_mask_TT.diagonal().all():
            raise ValueError("tree_mask_TT must include the diagonal (every token attends to itself)")
    if depth_T is not None:
        if depth_T.shape != (T,):
            raise ValueError(f"depth_T must have shape [T={T}], got {tuple(depth_T.shape)}")
        if depth_T.device.type == "cpu" and (
            (depth_T < 0).any() or (max(starts) + int(depth_T.max()) >= cache.max_len)
        ):
            raise ValueError("depth_T must be >= 0 and start_B + depth_T < max_len")
    if tokens_BT.device.type == "cpu":
        lo, hi = value_range(tokens_BT)
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"tokens_BT must be in [0, {vocab_size})")
    return tokens_BT, start_B, rows


def check_lengths(
    cache: StaticKVCache | None, lengths_B: Any, rows_B: Any
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``rollback``'s arguments: ``(lengths_B as a CPU long tensor, rows_B checked or None)``, each
    length in ``[0, the row's current length]``."""
    cache = need_cache(cache)
    lengths_B = torch.as_tensor(lengths_B, dtype=torch.long).reshape(-1).cpu()
    rows = check_rows(cache, rows_B, lengths_B.shape[0]) if rows_B is not None else None
    if rows is None and lengths_B.shape[0] != cache.batch_size:
        raise ValueError(f"lengths_B must have {cache.batch_size} entries, got {lengths_B.shape[0]}")
    new, held = lengths_B.tolist(), cache.lengths_B.tolist()
    current = held if rows is None else [held[r] for r in rows.tolist()]
    if any(n < 0 or n > c for n, c in zip(new, current, strict=True)):
        raise ValueError(
            f"lengths_B must be in [0, current length] per row; got {new}, cache holds {current}"
        )
    return lengths_B, rows


def check_copy(
    cache: StaticKVCache | None, src_slots_BN: Any, dst_start_B: Any, rows_B: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``copy_slots``' arguments: ``(src_slots_BN, dst_start_B, rows_B checked or None)`` as long
    tensors, every slot (checked where on the host) inside the cache."""
    cache = need_cache(cache)
    src = torch.as_tensor(src_slots_BN, dtype=torch.long)
    dst = torch.as_tensor(dst_start_B, dtype=torch.long).reshape(-1)
    B = cache.batch_size if rows_B is None else len(rows_B)
    rows = None if rows_B is None else check_rows(cache, rows_B, B)
    if src.ndim != 2 or src.shape[0] != B or dst.shape[0] != B:
        raise ValueError(
            f"src_slots_BN must be [B={B}, N] and dst_start_B [B]; got {tuple(src.shape)} and "
            f"{tuple(dst.shape)}"
        )
    on_host = src.device.type == "cpu" and dst.device.type == "cpu"  # device ones: trusted
    if (
        on_host
        and src.numel()
        and (
            src.min() < 0
            or src.max() >= cache.max_len
            or dst.min() < 0
            or (dst + src.shape[1]).max() > cache.max_len
        )
    ):
        raise ValueError(f"slots must lie in [0, max_len={cache.max_len})")
    return src, dst, rows


def check_layer_choice(total: int, num_layers: int | None, layers: Sequence[int] | None) -> Sequence[int]:
    """``forward_layers``' choice of layers: exactly one of ``num_layers`` (an int in ``[1, total]``:
    layers ``0..num_layers-1``) or ``layers`` (non-empty, increasing, in ``[0, total)``)."""
    if (num_layers is None) == (layers is None):
        raise ValueError("pass exactly one of num_layers or layers")
    if num_layers is not None:
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= total:
            raise ValueError(f"num_layers must be an int in [1, {total}], got {num_layers!r}")
        return range(num_layers)
    layers = list(layers)
    if not layers or any(not 0 <= i < total for i in layers) or layers != sorted(set(layers)):
        raise ValueError(
            f"layers must be a non-empty increasing list of indices in [0, {total}), got {layers}"
        )
    return layers


def check_logits_index(logits_index_BN: Any, B: int, T: int) -> torch.Tensor:
    """``logits_index_BN`` as a long tensor ``[B, N]`` with entries in ``[0, T)`` (values checked on
    the host; an index already on the device is trusted)."""
    idx = torch.as_tensor(logits_index_BN, dtype=torch.long)
    bad_shape = idx.ndim != 2 or idx.shape[0] != B
    if bad_shape or (idx.device.type == "cpu" and ((idx < 0).any() or (idx >= T).any())):
        raise ValueError(f"logits_index_BN must be [B, N] with entries in [0, {T}), got {tuple(idx.shape)}")
    return idx
