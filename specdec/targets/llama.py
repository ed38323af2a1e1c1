"""A lean native target for the Llama family (Llama, SmolLM2, Mistral, Qwen2, Qwen3), after gpt-fast.

Legend: B batch, T block length, N selected logit positions, V vocabulary, D model dim, H query
heads, J key/value heads, G query heads per key/value head (H = J·G), E head dim, S attended slots.

What makes it fast on a CPU, compared with ``transformers``:

- a static KV cache (``specdec.targets.kv_cache``): rollback moves a length, nothing is copied;
- fused weights (one q|k|v and one gate|up matrix per layer), so a decode step is 4 matrix products
  per layer plus the LM head;
- the LM head runs only where logits are wanted (``logits_index_BN``): prefill pays it once per row;
- the hot loop calls functional ops on plain tensors (no module dispatch, no hooks, no dynamic
  cache objects), and grouped-query attention runs as one attention per key/value head with the G
  query heads stacked as rows, so keys and values are never repeated;
- the linear layers' weights are packed in the layout the CPU kernel streams fastest, in the chosen
  format (``weights=``: ``fp32 | bf16 | gguf | int8 | int4``, or ``gguf-q8 | int8-q8 | int4-q8`` with
  8-bit activations; see ``specdec.targets.llama_weights``),
  quantised ones dequantised in registers;
- on a CPU, a block of up to ``kernels.llama_forward.MAX_BLOCK`` tokens runs the whole decoder in one
  C call (``kernels/csrc/llama_forward.c``); longer blocks (prefill) take the PyTorch path below,
  which is also the reference the native one is tested against.

With ``fp32`` or ``gguf`` weights the output equals ``transformers``' on the same (dequantised)
weights up to float accumulation order (tests check logits and token-for-token greedy equality on
SmolLM2). ``bf16`` / ``int8`` / ``int4`` change outputs slightly. Tree attention (SpecInfer, arXiv
2305.09781) is supported through ``tree_mask_TT`` / ``depth_T`` and :meth:`LlamaTarget.copy_slots`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from filelock import FileLock

from kernels.llama_forward import MAX_BLOCK
from specdec.checks import value_range
from specdec.protocols import TargetOutput, TargetParts
from specdec.targets.capture import check_layer_indices
from specdec.targets.default_weights import default_weights
from specdec.targets.kv_cache import StaticKVCache, block_attention_mask
from specdec.targets.linear import resolve_backend
from specdec.targets.llama_config import LlamaConfig, load_safetensors_state
from specdec.targets.llama_weights import (
    GGUF_MODES,
    WEIGHT_MODES,
    ModelWeights,
    build_weights,
    load_packed,
    native_decoder,
    packed_cache_path,
    save_packed,
)
from specdec.targets.placement import resolve_placement
from specdec.targets.rmsnorm import RMSNorm
from specdec.targets.rope import apply_rope_flipped, flip_sin, rope_cos_sin_table, rope_inv_freq

__all__ = ["LlamaConfig", "LlamaTarget", "load_safetensors_state", "PREFILL_CHUNK"]

PREFILL_CHUNK = 512
"""Longest block run in one pass: a longer (chain) block, a long prompt's prefill, runs in chunks of
this many tokens, so attention's mask and scores grow with the prompt, not with its square."""


class LlamaTarget:
    """A Llama-family causal LM implementing :class:`specdec.protocols.Target` with a static KV cache.

    Public for feature-level drafters: ``config``, ``embed_tokens`` (``nn.Embedding``), ``norm``
    (the final :class:`RMSNorm`), ``lm_head`` (``nn.Linear``: the float32 embedding when tied, else the
    head as stored), ``layers``, and
    :meth:`forward_layers` (a sub-network, for self-speculation). Extras beyond the protocol:
    tree attention in :meth:`forward` and :meth:`copy_slots`.

    ``weights``: the weight format (``WEIGHT_MODES``). ``dtype``: the compute dtype (activations, KV
    cache, float weights; ``None``: the format's own), ``device``: where every weight, the cache and
    every index tensor the target builds live; the combinations that run, and the defaults, are
    :func:`specdec.targets.placement.resolve_placement`'s (a ``ValueError`` names any other).
    ``linear_backend``: see :mod:`specdec.targets.linear` (``auto``: the packed kernels on a CPU in
    float32, PyTorch ops otherwise).

    Host and device: the cache's lengths (``cache.lengths_B``) and the block's starts are host-side
    bookkeeping, checked there; positions, masks, cache rows and slots are built on the device once
    per forward, so a forward on an accelerator reads nothing back from it. Index tensors handed in
    on the device (``logits_index_BN``, ``depth_T``, ``tree_mask_TT``) are trusted: checking their
    values would synchronise.
    """

    def __init__(
        self,
        config: LlamaConfig,
        state: dict[str, Any] | ModelWeights,
        *,
        weights: str = "fp32",
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        linear_backend: str = "auto",
        tokenizer: Any = None,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        if weights not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {weights!r}")
        if dtype is None and isinstance(state, ModelWeights):  # built weights: compute in their dtype
            dtype = state.compute_dtype
        self.config = config
        self.device = torch.device(device)
        self.linear_backend = resolve_backend(linear_backend, self.device, dtype)
        # the format (``fp32`` with a half dtype is stored in it) and the compute dtype
        self.weights, self.dtype = resolve_placement(weights, dtype, self.device, self.linear_backend)
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.vocab_size = config.vocab_size
        self.max_context_length = config.max_position_embeddings or None
        self.cache: StaticKVCache | None = None
        self.aux_layers: frozenset[int] = frozenset()  # see capture_layers
        if isinstance(state, ModelWeights):  # already built (a cache of packed weights)
            w = state
        else:
            w = build_weights(
                config,
                state,
                weights=self.weights,
                backend=self.linear_backend,
                device=self.device,
                dtype=self.dtype,
            )
        self.packed_weights = w
        self.layers, self._head, self.weight_bytes = w.layers, w.head, w.nbytes
        self.embed_tokens = torch.nn.Embedding.from_pretrained(w.embed_VD, freeze=True)
        self.norm = RMSNorm(w.norm_D, config.rms_norm_eps)
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False, device="meta")
        self.lm_head.weight = torch.nn.Parameter(w.head_VD(), requires_grad=False)  # shared when tied
        self._native = native_decoder(w, config) if self.linear_backend == "packed" else None
        self._inv_freq = rope_inv_freq(config.head_dim, config.rope_parameters).to(self.device)
        self._cos = self._sin = None

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | os.PathLike,
        *,
        weights: str = "auto",
        dtype: torch.dtype | None = None,
        **opts: Any,
    ) -> LlamaTarget:
        """Load a built-in name (``smollm2-135m``), a local checkpoint directory (safetensors only) or a
        ``.gguf`` file.

        ``weights``: a format of :data:`specdec.targets.llama_weights.WEIGHT_MODES`, or ``auto``
        (:func:`specdec.targets.default_weights.default_weights`): for a GGUF file (the built-in
        SmolLM2) ``gguf-q8`` where it is the faster exact path (packed kernels on an ISA path with
        integer dot products), else ``gguf``; ``fp32`` for a safetensors checkpoint.
        ``opts``: ``device``, ``linear_backend`` (see ``specdec.targets.linear``), ``load_tokenizer``
        (default True).
        """
        from specdec.targets.gguf import load_gguf_state
        from specdec.targets.loading import (
            gguf_source,
            load_eos_token_ids,
            load_hf_config,
            load_tokenizer,
            resolve_checkpoint,
        )

        with_tokenizer = opts.pop("load_tokenizer", True)
        path = resolve_checkpoint(name_or_path)
        config = LlamaConfig.from_hf(hf_config := load_hf_config(path))
        source = gguf_source(name_or_path)
        backend = resolve_backend(opts.get("linear_backend", "auto"), opts.get("device", "cpu"), dtype)
        if weights == "auto":
            weights = default_weights(source, dtype=dtype, linear_backend=backend)
        if weights in GGUF_MODES and source is None:
            raise ValueError(
                f"weights={weights!r} needs a GGUF file; {name_or_path} is a safetensors checkpoint"
            )
        cache, key = packed_cache_path(path, source if weights in GGUF_MODES else None, weights, backend)
        eos_ids = load_eos_token_ids(path, hf_config)
        tokenizer = load_tokenizer(path) if with_tokenizer else None
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
        # One process packs a checkpoint; others wait for its cache instead of packing it too.
        with FileLock(str(cache) + ".lock") if cache is not None else contextlib.nullcontext():
            state: Any = None if cache is None else load_packed(cache, key)
            if state is None and weights in GGUF_MODES:
                heads = {"num_heads": config.num_heads, "num_kv_heads": config.num_kv_heads}
                state = load_gguf_state(source, model_type=config.model_type, **heads)
            elif state is None:
                state = load_safetensors_state(path)
            extra = {"tokenizer": tokenizer, "eos_token_ids": eos_ids, **opts}
            target = cls(config, state, weights=weights, dtype=dtype, **extra)
            if cache is not None and not isinstance(state, ModelWeights):
                save_packed(target.packed_weights, cache, key)
        return target

    # ------------------------------------------------------------------ Target protocol
    def parts(self) -> TargetParts:
        """The embedding and final norm (float32) and LM head (as stored; float32 when tied or
        quantised), on the target's device, that feature-level draft heads share."""
        return TargetParts(
            self.embed_tokens.weight.detach(),
            self.norm.weight.detach(),
            self.norm.eps,
            self.lm_head.weight.detach(),
            self.config,
        )

    def capture_layers(self, layers: Sequence[int]) -> None:
        """Also return the outputs of decoder ``layers`` from :meth:`forward` (``aux_hidden_BTD``);
        requests add up, so drafters that share the target each get theirs."""
        self.aux_layers = self.aux_layers | frozenset(check_layer_indices(layers, self.config.num_layers))

    def reset(self, batch_size: int, max_len: int) -> None:
        """Allocate an empty cache of ``batch_size`` rows × ``max_len`` slots (reused if same shape)."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"max_len must be an int >= 1, got {max_len!r}")
        limit = self.max_context_length
        if limit is not None and max_len > limit:
            raise ValueError(
                f"max_len={max_len} exceeds the model's context length max_context_length={limit} "
                "(max_position_embeddings)"
            )
        window = self.config.sliding_window
        if window is not None and max_len > window:
            raise ValueError(
                f"max_len={max_len} exceeds the model's sliding_window={window}; sliding-window attention "
                "is not implemented by the native target (use max_len <= sliding_window or the 'hf' backend)"
            )
        c = self.config
        if self.cache is None or self.cache.batch_size != batch_size or self.cache.max_len != max_len:
            self.cache = StaticKVCache(
                num_layers=c.num_layers,
                batch_size=batch_size,
                num_kv_heads=c.num_kv_heads,
                max_len=max_len,
                head_dim=c.head_dim,
                dtype=self.dtype,
                device=self.device,
            )
            # computed in float32, applied in the compute dtype (as transformers does)
            cos, sin = rope_cos_sin_table(self._inv_freq, max_len)
            self._cos, self._sin = cos.to(self.dtype), flip_sin(sin).to(self.dtype)  # apply_rope_flipped
        self.cache.lengths_B = torch.zeros(batch_size, dtype=torch.long)

    def forward(
        self,
        tokens_BT: torch.Tensor,
        start_B: torch.Tensor,
        *,
        logits_index_BN: torch.Tensor | None = None,
        tree_mask_TT: torch.Tensor | None = None,
        depth_T: torch.Tensor | None = None,
        rows_B: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Run a block at cache slots ``start_B[b] + arange(T)``; see :class:`specdec.protocols.Target`.

        Tree verification: ``tree_mask_TT[i, j]`` (bool, diagonal set) lets block token i attend
        block token j, and ``depth_T`` gives each token's rope position offset (position
        ``start_B[b] + depth_T[i]``). Default: a causal chain, ``depth_T = arange(T)``.
        ``rows_B``: the cache rows the block's B rows use (distinct; the engine's request slots);
        default: every cache row in order (then B is the cache's batch size).
        """
        tokens_BT, start_B, rows_B = self._check_block(
            tokens_BT, start_B, tree_mask_TT, depth_T, rows_B=rows_B
        )
        aux: dict[int, torch.Tensor] = {}
        layers = range(self.config.num_layers)
        T = tokens_BT.shape[1]
        if tree_mask_TT is None and T > PREFILL_CHUNK:  # a chain in chunks: causal attention is the same
            chunks, parts = range(0, T, PREFILL_CHUNK), []
            for c in chunks:
                piece: dict[int, torch.Tensor] = {}
                parts.append(
                    (
                        self._run(
                            tokens_BT[:, c : c + PREFILL_CHUNK],
                            start_B + c,
                            layers,
                            None,
                            None,
                            piece,
                            rows_B,
                        ),
                        piece,
                    )
                )
            hidden_BTD = torch.cat([h for h, _ in parts], dim=1)
            aux = {i: torch.cat([p[i] for _, p in parts], dim=1) for i in parts[0][1]}
        else:
            hidden_BTD = self._run(tokens_BT, start_B, layers, tree_mask_TT, depth_T, aux, rows_B)
        if rows_B is None:
            self.cache.lengths_B = start_B + T
        else:
            self.cache.lengths_B[rows_B] = start_B + T
        return TargetOutput(
            logits_BTV=self._logits(hidden_BTD, logits_index_BN),
            hidden_BTD=hidden_BTD,
            aux_hidden_BTD=aux or None,
        )

    def rollback(self, lengths_B: torch.Tensor, rows_B: torch.Tensor | None = None) -> None:
        """Declare that row b's cache holds only its first ``lengths_B[b]`` slots (O(1): nothing moves).
        ``rows_B``: which cache rows ``lengths_B`` refers to (default: every row in order)."""
        cache = self._need_cache()
        lengths_B = torch.as_tensor(lengths_B, dtype=torch.long).reshape(-1).cpu()
        rows = self._check_rows(rows_B, lengths_B.shape[0]) if rows_B is not None else None
        if rows is None and lengths_B.shape[0] != cache.batch_size:
            raise ValueError(f"lengths_B must have {cache.batch_size} entries, got {lengths_B.shape[0]}")
        # Checked on Python lists: a few rows, where each small torch op costs more than the loop.
        new, held = lengths_B.tolist(), cache.lengths_B.tolist()
        current = held if rows is None else [held[r] for r in rows.tolist()]
        if any(n < 0 or n > c for n, c in zip(new, current, strict=True)):
            raise ValueError(
                f"lengths_B must be in [0, current length] per row; got {new}, cache holds {current}"
            )
        if rows is None:
            cache.lengths_B = lengths_B.clone()
        else:
            cache.lengths_B[rows] = lengths_B

    # ------------------------------------------------------------------ extras
    @torch.inference_mode()
    def copy_slots(
        self, src_slots_BN: torch.Tensor, dst_start_B: torch.Tensor, rows_B: torch.Tensor | None = None
    ) -> None:
        """Move the K/V at slots ``src_slots_BN[b]`` to ``dst_start_B[b] .. dst_start_B[b]+N-1``, every layer.

        After tree verification the accepted path's tokens sit at scattered slots of the tree
        block; this compacts them so the cache reads like a chain. Call ``rollback`` afterwards
        with the new lengths (``dst_start_B + N``). Rows with shorter paths may pad ``src_slots_BN``
        with any slot: whatever lands past a row's new length is never read.
        """
        cache = self._need_cache()
        src = torch.as_tensor(src_slots_BN, dtype=torch.long)
        dst = torch.as_tensor(dst_start_B, dtype=torch.long).reshape(-1)
        B = cache.batch_size if rows_B is None else len(rows_B)
        rows = None if rows_B is None else self._check_rows(rows_B, B)
        if src.ndim != 2 or src.shape[0] != B or dst.shape[0] != B:
            raise ValueError(
                f"src_slots_BN must be [B={B}, N] and dst_start_B [B]; got "
                f"{tuple(src.shape)} and {tuple(dst.shape)}"
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
        rows = None if rows is None else rows.to(self.device)
        cache.copy_slots(src.to(self.device), dst.to(self.device), rows)

    def forward_layers(
        self,
        tokens_BT: torch.Tensor,
        start_B: torch.Tensor,
        *,
        num_layers: int | None = None,
        layers: Sequence[int] | None = None,
        logits_index_BN: torch.Tensor | None = None,
        rows_B: torch.Tensor | None = None,
    ) -> TargetOutput:
        """A sub-network of the target: some of its layers, then the final norm and LM head.

        ``num_layers=N`` runs layers ``0..N-1`` (early exit, LayerSkip arXiv 2404.16710);
        ``layers`` runs the given increasing layer indices and skips the rest (Draft & Verify,
        arXiv 2309.08168). Writes the keys/values of the layers it runs and leaves the cache's
        lengths alone: the next full ``forward`` over the same slots overwrites them
        (self-speculation, ``specdec.drafters.layerskip``). ``hidden_BTD`` is the last run
        layer's output. ``rows_B``: the cache rows the block's B rows use, as in :meth:`forward`
        (default: every cache row in order).
        """
        L = self.config.num_layers
        if (num_layers is None) == (layers is None):
            raise ValueError("pass exactly one of num_layers or layers")
        if num_layers is not None:
            if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= L:
                raise ValueError(f"num_layers must be an int in [1, {L}], got {num_layers!r}")
            layers = range(num_layers)
        else:
            layers = list(layers)
            if not layers or any(not 0 <= i < L for i in layers) or layers != sorted(set(layers)):
                raise ValueError(
                    f"layers must be a non-empty increasing list of indices in [0, {L}), got {layers}"
                )
        tokens_BT, start_B, rows = self._check_block(
            tokens_BT, start_B, None, None, check_length=False, rows_B=rows_B
        )
        hidden_BTD = self._run(tokens_BT, start_B, layers, None, None, rows_B=rows)
        return TargetOutput(logits_BTV=self._logits(hidden_BTD, logits_index_BN), hidden_BTD=hidden_BTD)

    # ------------------------------------------------------------------ internals
    def _need_cache(self) -> StaticKVCache:
        if self.cache is None:
            raise ValueError("call reset(batch_size, max_len) before using the target")
        return self.cache

    def _check_rows(self, rows_B: Any, B: int) -> torch.Tensor:
        """``rows_B`` as a CPU long tensor of B distinct cache rows, or a ``ValueError``."""
        cache = self._need_cache()
        rows = torch.as_tensor(rows_B, dtype=torch.long).reshape(-1).cpu()
        values = rows.tolist()
        if (
            len(values) != B
            or len(set(values)) != len(values)
            or any(not 0 <= r < cache.batch_size for r in values)
        ):
            raise ValueError(
                f"rows_B must hold {B} distinct cache rows in [0, {cache.batch_size}), got {values}"
            )
        return rows

    def _check_block(self, tokens_BT, start_B, tree_mask_TT, depth_T, check_length: bool = True, rows_B=None):
        cache = self._need_cache()
        if (
            not isinstance(tokens_BT, torch.Tensor)
            or tokens_BT.ndim != 2
            or tokens_BT.dtype
            not in (
                torch.long,
                torch.int32,
            )
        ):
            raise ValueError(
                f"tokens_BT must be an integer tensor [B, T], got {getattr(tokens_BT, 'shape', tokens_BT)}"
            )
        B, T = tokens_BT.shape
        rows = None if rows_B is None else self._check_rows(rows_B, B)
        if (rows is None and B != cache.batch_size) or T < 1:
            raise ValueError(f"tokens_BT must be [B={cache.batch_size}, T>=1], got {tuple(tokens_BT.shape)}")
        start_B = torch.as_tensor(start_B, dtype=torch.long).reshape(-1).cpu()
        if start_B.shape[0] != B:
            raise ValueError(f"start_B must have {B} entries, got {start_B.shape[0]}")
        starts = start_B.tolist()  # checked as a list: see rollback
        if any(s < 0 or s + T > cache.max_len for s in starts):
            raise ValueError(f"blocks must fit in [0, max_len={cache.max_len}); start_B={starts}, T={T}")
        held = cache.lengths_B.tolist()
        held = held if rows is None else [held[r] for r in rows.tolist()]
        if check_length and any(s > h for s, h in zip(starts, held, strict=True)):
            raise ValueError(f"start_B={starts} is past the cached lengths {held} (a gap)")
        # Values are checked where they are on the host; tensors already on an accelerator are
        # trusted (reading them back would synchronise every forward).
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
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(f"tokens_BT must be in [0, {self.vocab_size})")
        return tokens_BT.to(self.device), start_B, rows

    @torch.inference_mode()
    def _run(
        self,
        tokens_BT: torch.Tensor,
        start_B: torch.Tensor,
        layers: Sequence[int],
        tree_mask_TT: torch.Tensor | None,
        depth_T: torch.Tensor | None,
        aux_out: dict[int, torch.Tensor] | None = None,
        rows_B: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Embed, run ``layers`` in order (writing their K/V), return the last one's output (and put
        the outputs of the layers in ``aux_layers`` into ``aux_out``). Where the native forward runs
        here, every chain block takes it: one of up to ``kernels.llama_forward.MAX_BLOCK`` tokens in
        one call, a longer one (a prompt's prefill) in consecutive chunks of ``MAX_BLOCK`` (each
        chunk reads the previous chunks' K/V from the cache, as a causal block does). A token's
        output is then the same whatever block it comes in (the native forward is block-length
        invariant; the PyTorch path below rounds otherwise, and with 8-bit activations a rounding
        difference can flip a quantised value). Trees of more than ``MAX_BLOCK`` nodes take the
        PyTorch path."""
        c = self.config
        B, T = tokens_BT.shape
        if self._native is not None and T <= MAX_BLOCK:
            return self._run_native(tokens_BT, start_B, layers, tree_mask_TT, depth_T, aux_out, rows_B)
        if self._native is not None and tree_mask_TT is None and depth_T is None:
            return self._run_native_chunks(tokens_BT, start_B, layers, aux_out, rows_B)
        starts = start_B.tolist()  # start_B is host-side bookkeeping (see _check_block)
        uniform = starts[0] if starts.count(starts[0]) == B else None
        num_slots = max(starts) + T
        # every index tensor on the device once per forward, never a host copy per layer
        start_dev_B = start_B.to(self.device)
        rows_dev_B = None if rows_B is None else rows_B.to(self.device)
        offsets_T = torch.arange(T, device=self.device) if depth_T is None else depth_T.to(self.device)
        positions_BT = start_dev_B[:, None] + offsets_T[None, :]
        cos_BT1E, sin_BT1E = self._cos[positions_BT][:, :, None], self._sin[positions_BT][:, :, None]

        G = c.num_heads // c.num_kv_heads
        mask = None
        if tree_mask_TT is not None or uniform is None or T > 1:
            block_TT = (
                tree_mask_TT.to(self.device)
                if tree_mask_TT is not None
                else torch.ones(T, T, dtype=torch.bool, device=self.device).tril()
            )
            # The G query heads of a key/value head are stacked as G·T rows (row g·T + t). Additive
            # (0 / -inf) once per forward: a bool mask is converted in every layer's attention call
            # (same result bit for bit; ~5 µs of ~40 per layer at 7 tokens here).
            allowed = block_attention_mask(start_dev_B, num_slots, block_TT).repeat(1, 1, G, 1)
            mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)  # the query's dtype
            mask.masked_fill_(~allowed, float("-inf"))

        x_BTD = self.embed_tokens.weight[tokens_BT].to(self.dtype)  # float32 table, rows in the dtype
        for i in layers:
            x_BTD = self._layer(
                i, x_BTD, cos_BT1E, sin_BT1E, start_dev_B, uniform, num_slots, mask, rows_dev_B
            )
            if aux_out is not None and i in self.aux_layers:
                aux_out[i] = x_BTD
        return x_BTD

    def _run_native_chunks(self, tokens_BT, start_B, layers, aux_out, rows_B=None) -> torch.Tensor:
        """A chain block longer than ``MAX_BLOCK`` through the native forward, chunk by chunk."""
        outs, chunk_aux = [], []
        for s in range(0, tokens_BT.shape[1], MAX_BLOCK):
            part_aux: dict[int, torch.Tensor] | None = None if aux_out is None else {}
            outs.append(
                self._run_native(
                    tokens_BT[:, s : s + MAX_BLOCK], start_B + s, layers, None, None, part_aux, rows_B
                )
            )
            chunk_aux.append(part_aux)
        if aux_out is not None:
            for i in chunk_aux[0]:
                aux_out[i] = torch.cat([a[i] for a in chunk_aux], dim=1)
        return torch.cat(outs, dim=1)

    def _run_native(
        self, tokens_BT, start_B, layers, tree_mask_TT, depth_T, aux_out, rows_B=None
    ) -> torch.Tensor:
        """:meth:`_run` in one call of the native forward (``kernels.llama_forward``)."""
        B, T = tokens_BT.shape
        offsets_T = torch.arange(T) if depth_T is None else depth_T.to(torch.long).cpu()
        positions_M = (start_B[:, None] + offsets_T[None, :]).reshape(-1)
        x_MD = self.embed_tokens.weight[tokens_BT.reshape(-1)].contiguous()
        capture = [i for i in layers if i in self.aux_layers] if aux_out is not None else []
        cache = self.cache
        outs = self._native.forward(
            x_MD,
            start_B,
            self._cos[positions_M],
            self._sin[positions_M],
            cache.k_NBHLD,
            cache.v_NBHLD,
            tree_mask_TT,
            list(layers),
            capture,
            rows_B,
        )
        for i, out in zip(capture, outs, strict=True):
            aux_out[i] = out.view(B, T, -1)
        return x_MD.view(B, T, -1)

    def _layer(
        self, i, x_BTD, cos_BT1E, sin_BT1E, start_B, uniform, num_slots, mask, rows_B=None
    ) -> torch.Tensor:
        c, layer, cache = self.config, self.layers[i], self.cache
        B, T, _ = x_BTD.shape
        H, J, E = c.num_heads, c.num_kv_heads, c.head_dim
        G = H // J

        qkv = layer.qkv(x_BTD).view(B, T, H + 2 * J, E)
        qk = qkv[:, :, : H + J]
        if layer.qk_norm is not None:  # Qwen3: RMSNorm over each head before rope, in float32
            qk32 = qk.float()
            qk32 = layer.qk_norm * (qk32 * torch.rsqrt(qk32.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps))
            qk = qk32.to(qkv.dtype)
        qk = apply_rope_flipped(qk, cos_BT1E, sin_BT1E)
        q_BTHE, k_BTJE, v_BTJE = qk[:, :, :H], qk[:, :, H:], qkv[:, :, H + J :]
        cache.write(i, k_BTJE, v_BTJE, start_B, uniform, rows_B)

        if rows_B is None:
            k_BJSE = cache.k_NBHLD[i, :, :, :num_slots]
            v_BJSE = cache.v_NBHLD[i, :, :, :num_slots]
        else:  # a subset of the cache's rows (one gather per layer; prefill chunks and fallbacks only)
            k_BJSE = cache.k_NBHLD[i, rows_B, :, :num_slots]
            v_BJSE = cache.v_NBHLD[i, rows_B, :, :num_slots]
        q_BJRE = q_BTHE.reshape(B, T, J, G, E).permute(0, 2, 3, 1, 4).reshape(B, J, G * T, E)
        o_BJRE = F.scaled_dot_product_attention(q_BJRE, k_BJSE, v_BJSE, attn_mask=mask, scale=E**-0.5)
        o_BTF = o_BJRE.view(B, J, G, T, E).permute(0, 3, 1, 2, 4).reshape(B, T, H * E)
        x_BTD = layer.o(o_BTF, x_BTD)
        return layer.down(layer.gate_up(x_BTD), x_BTD)

    @torch.inference_mode()
    def _logits(self, hidden_BTD: torch.Tensor, logits_index_BN: torch.Tensor | None) -> torch.Tensor:
        """float32 logits (the head runs in the compute dtype) at ``logits_index_BN`` (checked on the
        host, then moved to the device once; an index already on the device is trusted)."""
        if logits_index_BN is not None:
            idx = torch.as_tensor(logits_index_BN, dtype=torch.long)
            T = hidden_BTD.shape[1]
            bad_shape = idx.ndim != 2 or idx.shape[0] != hidden_BTD.shape[0]
            if bad_shape or (idx.device.type == "cpu" and ((idx < 0).any() or (idx >= T).any())):
                raise ValueError(
                    f"logits_index_BN must be [B, N] with entries in [0, {T}), got {tuple(idx.shape)}"
                )
            idx = idx.to(self.device)
            hidden_BTD = hidden_BTD.gather(1, idx[:, :, None].expand(-1, -1, hidden_BTD.shape[-1]))
        logits = self._head(hidden_BTD)
        return logits if logits.dtype == torch.float32 else logits.float()
