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
  query heads stacked as rows, so keys and values are never repeated
  (:mod:`specdec.targets.llama_layer`);
- the linear layers' weights are packed in the layout the CPU kernel streams fastest, in the chosen
  format (``weights=``: ``fp32 | bf16 | gguf | int8 | int4``, or ``gguf-q8 | int8-q8 | int4-q8`` with
  8-bit activations; see ``specdec.targets.llama_weights``),
  quantised ones dequantised in registers;
- on a CPU, a block of up to ``kernels.llama_forward.MAX_BLOCK`` tokens runs the whole decoder in one
  C call (:mod:`specdec.targets.llama_native`); longer blocks (prefill) take the PyTorch path,
  which is also the reference the native one is tested against.

The files: this one holds the target (the protocol's methods and which path runs a block);
:mod:`~specdec.targets.llama_layer` the PyTorch decoder layer and its attention mask,
:mod:`~specdec.targets.llama_native` the native forward's calls, :mod:`~specdec.targets.llama_checks`
the argument checks, :mod:`~specdec.targets.llama_pretrained` loading by name, and
:mod:`~specdec.targets.llama_weights` the weights.

With ``fp32`` or ``gguf`` weights the output equals ``transformers``' on the same (dequantised)
weights up to float accumulation order (tests check logits and token-for-token greedy equality on
SmolLM2). ``bf16`` / ``int8`` / ``int4`` change outputs slightly. Tree attention (SpecInfer, arXiv
2305.09781) is supported through ``tree_mask_TT`` / ``depth_T`` and :meth:`LlamaTarget.copy_slots`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from kernels.llama_forward import MAX_BLOCK
from specdec.protocols import TargetOutput, TargetParts
from specdec.targets.capture import check_layer_indices
from specdec.targets.kv_cache import StaticKVCache
from specdec.targets.linear import resolve_backend
from specdec.targets.llama_checks import (
    check_block,
    check_cache_shape,
    check_copy,
    check_layer_choice,
    check_lengths,
    check_logits_index,
    check_rows,
)
from specdec.targets.llama_config import LlamaConfig, load_safetensors_state
from specdec.targets.llama_layer import decoder_layer, stacked_attention_mask
from specdec.targets.llama_native import run_native
from specdec.targets.llama_weights import WEIGHT_MODES, ModelWeights, build_weights, native_decoder
from specdec.targets.placement import resolve_placement
from specdec.targets.rmsnorm import RMSNorm
from specdec.targets.rope import flip_sin, rope_cos_sin_table, rope_inv_freq

__all__ = ["LlamaConfig", "LlamaTarget", "load_safetensors_state", "PREFILL_CHUNK"]

PREFILL_CHUNK = 512
"""Longest block run in one pass: a longer (chain) block, a long prompt's prefill, runs in chunks of
this many tokens, so attention's mask and scores grow with the prompt, not with its square."""


class LlamaTarget:
    """A Llama-family causal LM implementing :class:`specdec.protocols.Target` with a static KV cache.

    Public for feature-level drafters: ``config``, ``embed_tokens`` (``nn.Embedding``), ``norm``
    (the final :class:`RMSNorm`), ``lm_head`` (``nn.Linear``: the embedding when tied, else the
    head as stored), ``layers``, and
    :meth:`forward_layers` (a sub-network, for self-speculation). Extras beyond the protocol:
    tree attention in :meth:`forward` and :meth:`copy_slots`.

    ``weights``: the weight format (``WEIGHT_MODES``). ``dtype``: the compute dtype (activations, KV
    cache, float weights; ``None``: the format's own), ``device``: where every weight, the cache and
    every index tensor the target builds live; the combinations that run, and the defaults, are
    :func:`specdec.targets.placement.resolve_placement`'s (a ``ValueError`` names any other). The
    embedding table is stored as the float weights are (bf16 in a ``bf16`` model, whatever the
    compute dtype). ``linear_backend``: see :mod:`specdec.targets.linear` (``auto``: the packed
    kernels on a CPU in float32, PyTorch ops otherwise).

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
        ``.gguf`` file (:mod:`specdec.targets.llama_pretrained`).

        ``weights``: a format of :data:`specdec.targets.llama_weights.WEIGHT_MODES`, or ``auto``
        (:func:`specdec.targets.default_weights.default_weights`): for a GGUF file (the built-in
        SmolLM2) ``gguf-q8`` where it is the faster exact path (packed kernels on an ISA path with
        integer dot products), else ``gguf``; ``fp32`` for a safetensors checkpoint.
        ``opts``: ``device``, ``linear_backend`` (see ``specdec.targets.linear``), ``load_tokenizer``
        (default True).
        """
        from specdec.targets.llama_pretrained import load_pretrained

        return load_pretrained(cls, name_or_path, weights=weights, dtype=dtype, **opts)

    # ------------------------------------------------------------------ Target protocol
    def parts(self) -> TargetParts:
        """The embedding (as stored: the float weights' dtype), the float32 final norm and the LM head
        (as stored; the embedding when tied, float32 when quantised), on the target's device, that
        feature-level draft heads share."""
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

    def cost_identity(self) -> dict[str, Any]:
        """What a forward's cost depends on besides the machine (never the weights' values): the
        architecture, weight format, kernels, dtype, device and the captured layers; the key of a
        verify-cost grid kept per machine (:mod:`specdec.engine.cost_cache`)."""
        return {
            "class": type(self).__name__,
            "config": repr(self.config),
            "weights": self.weights,
            "linear_backend": self.linear_backend,
            "dtype": str(self.dtype),
            "device": self.device.type,
            "aux_layers": sorted(self.aux_layers),
        }

    def reset(self, batch_size: int, max_len: int) -> None:
        """Allocate an empty cache of ``batch_size`` rows × ``max_len`` slots (reused if same shape)."""
        c = self.config
        check_cache_shape(c, batch_size, max_len, self.max_context_length)
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
            parts = []
            for c in range(0, T, PREFILL_CHUNK):
                piece: dict[int, torch.Tensor] = {}
                chunk_BT = tokens_BT[:, c : c + PREFILL_CHUNK]
                parts.append((self._run(chunk_BT, start_B + c, layers, None, None, piece, rows_B), piece))
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
        lengths_B, rows = check_lengths(self.cache, lengths_B, rows_B)
        if rows is None:
            self.cache.lengths_B = lengths_B.clone()
        else:
            self.cache.lengths_B[rows] = lengths_B

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
        src, dst, rows = check_copy(self.cache, src_slots_BN, dst_start_B, rows_B)
        rows = None if rows is None else rows.to(self.device)
        self.cache.copy_slots(src.to(self.device), dst.to(self.device), rows)

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
        layers = check_layer_choice(self.config.num_layers, num_layers, layers)
        tokens_BT, start_B, rows = self._check_block(
            tokens_BT, start_B, None, None, check_length=False, rows_B=rows_B
        )
        hidden_BTD = self._run(tokens_BT, start_B, layers, None, None, rows_B=rows)
        return TargetOutput(logits_BTV=self._logits(hidden_BTD, logits_index_BN), hidden_BTD=hidden_BTD)

    # ------------------------------------------------------------------ internals
    def _check_rows(self, rows_B: Any, B: int) -> torch.Tensor:
        """``rows_B`` as a CPU long tensor of B distinct cache rows, or a ``ValueError``."""
        return check_rows(self.cache, rows_B, B)

    def _check_block(self, tokens_BT, start_B, tree_mask_TT, depth_T, check_length: bool = True, rows_B=None):
        """:func:`specdec.targets.llama_checks.check_block`, the tokens moved to the device."""
        block = (tokens_BT, start_B, tree_mask_TT, depth_T)
        checked = check_block(self.cache, self.vocab_size, *block, check_length=check_length, rows_B=rows_B)
        tokens_BT, start_B, rows = checked
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
        if self._native is not None and (T <= MAX_BLOCK or (tree_mask_TT is None and depth_T is None)):
            capture = [i for i in layers if i in self.aux_layers] if aux_out is not None else []
            tables = (self._native, self.cache, self.embed_tokens.weight, self._cos, self._sin)
            return run_native(
                *tables, tokens_BT, start_B, layers, tree_mask_TT, depth_T, capture, aux_out, rows_B
            )
        starts = start_B.tolist()  # start_B is host-side bookkeeping (see _check_block)
        uniform = starts[0] if starts.count(starts[0]) == B else None
        num_slots = max(starts) + T
        # every index tensor on the device once per forward, never a host copy per layer
        start_dev_B = start_B.to(self.device)
        rows_dev_B = None if rows_B is None else rows_B.to(self.device)
        offsets_T = torch.arange(T, device=self.device) if depth_T is None else depth_T.to(self.device)
        positions_BT = start_dev_B[:, None] + offsets_T[None, :]
        cos_BT1E, sin_BT1E = self._cos[positions_BT][:, :, None], self._sin[positions_BT][:, :, None]

        mask = None
        if tree_mask_TT is not None or uniform is None or T > 1:
            block_TT = (
                tree_mask_TT.to(self.device)
                if tree_mask_TT is not None
                else torch.ones(T, T, dtype=torch.bool, device=self.device).tril()
            )
            G = c.num_heads // c.num_kv_heads
            mask = stacked_attention_mask(start_dev_B, num_slots, block_TT, G, self.dtype)

        x_BTD = self.embed_tokens.weight[tokens_BT].to(self.dtype)  # the table's rows, in the dtype
        for i in layers:
            x_BTD = self._layer(
                i, x_BTD, cos_BT1E, sin_BT1E, start_dev_B, uniform, num_slots, mask, rows_dev_B
            )
            if aux_out is not None and i in self.aux_layers:
                aux_out[i] = x_BTD
        return x_BTD

    def _layer(
        self, i, x_BTD, cos_BT1E, sin_BT1E, start_B, uniform, num_slots, mask, rows_B=None
    ) -> torch.Tensor:
        """Decoder layer ``i`` in PyTorch ops (:func:`specdec.targets.llama_layer.decoder_layer`)."""
        block = (x_BTD, cos_BT1E, sin_BT1E, start_B, uniform, num_slots, mask, rows_B)
        return decoder_layer(self.config, self.layers[i], self.cache, i, *block)

    @torch.inference_mode()
    def _logits(self, hidden_BTD: torch.Tensor, logits_index_BN: torch.Tensor | None) -> torch.Tensor:
        """float32 logits (the head runs in the compute dtype) at ``logits_index_BN`` (checked on the
        host, then moved to the device once; an index already on the device is trusted)."""
        if logits_index_BN is not None:
            idx = check_logits_index(logits_index_BN, hidden_BTD.shape[0], hidden_BTD.shape[1])
            idx = idx.to(self.device)
            hidden_BTD = hidden_BTD.gather(1, idx[:, :, None].expand(-1, -1, hidden_BTD.shape[-1]))
        logits = self._head(hidden_BTD)
        return logits if logits.dtype == torch.float32 else logits.float()
