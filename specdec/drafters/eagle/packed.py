"""The draft head's inference fast path: the same function as ``EagleHead``, in fused CPU kernels.

Legend: B batch, T block length, D hidden size, H query heads, G key/value heads, d head dim,
N draft vocabulary, I input features.

Built from a trained :class:`~specdec.drafters.eagle.model.EagleHead` (its oracle), it runs every
matrix product through :mod:`specdec.targets.linear` (the layout the CPU multiplies fastest for a
few rows) with the elementwise ops around them fused in:

- the input scales folded into ``fc``'s (and ``fc_aux``'s) columns;
- the residual add fused into ``o_proj`` and ``down_proj``, ``post_norm``'s RMSNorm into
  ``gate_up_proj``, the SwiGLU into ``down_proj``'s input;
- the target's final norm fused into the draft LM head;
- q and k rotated together by :func:`specdec.targets.rope.apply_rope_flipped`.

A draft step is then five kernel calls plus attention. ``weight_dtype`` sets how the weights are
stored: a draft token streams ~36 MB of float32 weights (the layer and 8,192 LM-head rows), bound by
memory bandwidth like the target, so ``torch.bfloat16`` (the default where the packed kernel runs)
halves that; the trained layer weights are bf16 values already (that is how they ship). Activations
stay float32. With ``int8`` the layer's four products take int8 rows (per-row scales, float
activations) and the draft LM head (8,192 of the target's LM-head rows) int8 rows with 8-bit
activations, as a ``gguf-q8`` target runs its own LM head; ``fc`` / ``fc_aux`` (raw target features,
wide in range) stay as they are. :func:`~specdec.drafters.eagle.weights.load_packed_head` sets it for
a ``gguf-q8`` target (what that costs and saves: docs/eagle.md).
It exposes the interface :class:`~specdec.drafters.eagle.cache.EagleCache` calls.
"""

from __future__ import annotations

import torch

from kernels.quant import quantize_int8
from specdec.drafters.eagle.model import EagleHead, RopeTable, check_aux, fc_inputs, fc_scales
from specdec.targets.linear import PackedLinear
from specdec.targets.rope import apply_rope_flipped, flip_sin

__all__ = ["PackedEagleHead"]


class PackedEagleHead:
    """An attached :class:`EagleHead`'s weights, folded and packed for inference (see the module doc)."""

    def __init__(
        self,
        head: EagleHead,
        *,
        backend: str = "auto",
        weight_dtype: torch.dtype | None = None,
        int8: bool = False,
    ) -> None:
        if head.head_ND is None:
            raise ValueError("attach the head to its target (EagleHead.attach) before packing it")
        c = self.config = head.config
        dtype = weight_dtype or head.fc.weight.dtype
        w = lambda m: m.weight.detach()
        pack = lambda weight, bias=None, **kw: PackedLinear(weight, bias, backend=backend, dtype=dtype, **kw)
        D = c.hidden_size
        scale_I = torch.cat([torch.full((D,), x) for x in fc_scales(c)]).to(head.fc.weight.device)
        self.fc = pack(w(head.fc).float() * scale_I, head.fc.bias.detach())  # folded in float32
        self.fc_aux = None
        if head.fc_aux is not None:
            scales = torch.tensor([*c.aux_scales, c.feature_scale], dtype=torch.float32)
            aux_scale_I = scales.repeat_interleave(D).to(head.fc_aux.weight.device)
            self.fc_aux = pack(w(head.fc_aux).float() * aux_scale_I / c.feature_scale)
        # the layer's products (int8: int8 rows, float activations)
        layer = (lambda weight, **kw: pack(quantize_int8(weight.float()), **kw)) if int8 else pack
        self.qkv_proj = layer(w(head.qkv_proj))
        self.o_proj = layer(w(head.o_proj))
        self.gate_up_proj = layer(
            w(head.gate_up_proj), norm_weight_I=head.post_norm.detach(), norm_eps=head.norm_eps
        )
        self.down_proj = layer(w(head.down_proj), swiglu=True)
        if int8:  # int8 rows, 8-bit activations: the target's own LM-head precision
            self.lm_head = PackedLinear(
                quantize_int8(head.head_ND.detach().float()),
                norm_weight_I=head.norm_D,
                norm_eps=head.norm_eps,
                backend=backend,
                act8=True,
            )
        else:
            self.lm_head = pack(head.head_ND, norm_weight_I=head.norm_D, norm_eps=head.norm_eps)
        self.embed_VD = head.embed_VD
        self.draft_vocab_N = head.draft_vocab_N
        self.device = head.fc.weight.device
        self.rope = RopeTable(c)
        self._flipped: tuple[torch.Tensor, torch.Tensor] | None = None

    def project(self, feature_BTD: torch.Tensor, aux_BTAD: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`EagleHead.project`: the EAGLE-3 fused input feature (EAGLE-1: ``feature_BTD``)."""
        if self.fc_aux is None:
            return feature_BTD
        return self.fc_aux(check_aux(self.config, feature_BTD, aux_BTAD))

    def fuse(
        self, feature_BTD: torch.Tensor, tokens_BT: torch.Tensor, prev_tokens_BT: torch.Tensor | None = None
    ) -> torch.Tensor:
        """:meth:`EagleHead.fuse` (the input scales are folded into ``fc``'s columns)."""
        return self.fc(
            torch.cat(fc_inputs(self.config, self.embed_VD, feature_BTD, tokens_BT, prev_tokens_BT), -1)
        )

    def qkv(self, h_BTD: torch.Tensor, positions_BT: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """:meth:`EagleHead.qkv`, q and k rotated in one op (the same floats)."""
        c = self.config
        B, T, _ = h_BTD.shape
        H, G, d = c.num_heads, c.num_kv_heads, c.head_dim
        qkv_BTCd = self.qkv_proj(h_BTD).view(B, T, H + 2 * G, d)
        cos_BTd, flipped_sin_BTd = self._rope(positions_BT)
        qk = apply_rope_flipped(qkv_BTCd[:, :, : H + G], cos_BTd.unsqueeze(2), flipped_sin_BTd.unsqueeze(2))
        return (
            qk[:, :, :H].transpose(1, 2),
            qk[:, :, H:].transpose(1, 2),
            qkv_BTCd[:, :, H + G :].transpose(1, 2),
        )

    def _rope(self, positions_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.rope.lookup(positions_BT)  # grows the table when needed
        if self._flipped is None or self._flipped[0].shape != self.rope.cos_PD.shape:
            self._flipped = (self.rope.cos_PD, flip_sin(self.rope.sin_PD))
        return self._flipped[0][positions_BT], self._flipped[1][positions_BT]

    def finish(self, h_BTD: torch.Tensor, attn_BHTd: torch.Tensor) -> torch.Tensor:
        """:meth:`EagleHead.finish` (residuals, post-norm and SwiGLU fused into the kernels)."""
        B, H, T, d = attn_BHTd.shape
        h_BTD = self.o_proj(attn_BHTd.transpose(1, 2).reshape(B, T, H * d), h_BTD)
        return self.down_proj(self.gate_up_proj(h_BTD), h_BTD)

    def feature(self, h_BTD: torch.Tensor) -> torch.Tensor:
        """:meth:`EagleHead.feature`."""
        return h_BTD / self.config.feature_scale

    def logits(self, feature_BTD: torch.Tensor) -> torch.Tensor:
        """:meth:`EagleHead.logits` (the final norm fused into the kernel)."""
        return self.lm_head(feature_BTD)
