"""EAGLE-3's draft layer as vLLM, SGLang and ``speculators`` define it: the ``"eagle3"`` layout.

Legend: B batch, T block length, D hidden size, F MLP size, H query heads, G key/value heads,
d head dim, N draft vocabulary, V target vocabulary, A aux layers.

Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test" (arXiv 2503.01840). The target's hidden states at A layers (a low, a middle and
a high one) are fused into one input state; one decoder layer whose attention reads both the next
token's embedding and that state predicts the next state::

    g_t   = fc([a_1; …; a_A])                                  (no bias)
    x     = [input_norm(embed(x_{t+1})); hidden_norm(g_t)]     (2D: q, k, v read both)
    h     = r + o_proj(attn(x)),  r = g_t  (or hidden_norm(g_t) with norm_before_residual)
    ĝ_{t+1} = h + down(silu(gate(post_norm(h))) · up(post_norm(h)))
    draft_logits(x_{t+2}) = lm_head(norm(ĝ_{t+1}))               (its own norm and N × D head)

The next draft step feeds ĝ back as the hidden state (not through ``fc``). Unlike this project's
own layout (:class:`~specdec.drafters.eagle.model.EagleHead`), the head owns its final norm and LM
head, and the target's last-layer feature is not an input. :class:`Eagle3Head` has the step
interface :class:`~specdec.drafters.eagle.cache.EagleCache` calls (``fuse``, ``qkv``, ``finish``,
``feature``, ``logits``); ``fuse`` returns ``[B, T, 3D]``: the attention input ``x`` (2D) and the
residual ``r`` (D). It is the plain PyTorch path (no packed fast path for this layout yet).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdec.drafters.eagle.config import EagleConfig
from specdec.drafters.eagle.model import RopeTable, check_aux, rotated_heads
from specdec.protocols import TargetParts
from specdec.targets.rmsnorm import rms_norm

__all__ = ["Eagle3Head"]


class Eagle3Head(nn.Module):
    """EAGLE-3's layer (module doc). Parameters: ``fc``, ``input_norm``, ``hidden_norm``,
    ``qkv_proj`` (over 2D), ``o_proj``, ``post_norm``, ``gate_up_proj``, ``down_proj``, ``norm``
    and ``lm_head`` (rows: the draft vocabulary sorted by target id). The embedding is the target's
    (set by :meth:`attach`)."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        if config.layout != "eagle3":
            raise ValueError(f"Eagle3Head needs an 'eagle3' layout config, got layout={config.layout!r}")
        c = self.config = config
        D, A = c.hidden_size, len(c.aux_layers)
        self.fc = nn.Linear(A * D, D, bias=False)
        self.input_norm = nn.Parameter(torch.ones(D))
        self.hidden_norm = nn.Parameter(torch.ones(D))
        self.qkv_proj = nn.Linear(2 * D, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, D, bias=False)
        self.post_norm = nn.Parameter(torch.ones(D))
        self.gate_up_proj = nn.Linear(D, 2 * c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, D, bias=False)
        self.norm = nn.Parameter(torch.ones(D))
        self.lm_head = nn.Parameter(torch.zeros(c.draft_vocab_size, D))
        self.register_buffer("draft_vocab_N", torch.arange(c.draft_vocab_size), persistent=True)
        self.rope = RopeTable(c)
        self.norm_eps = c.rms_norm_eps
        self.embed_VD: torch.Tensor | None = None
        self.fc_aux = None  # the EAGLE-1/our-layout hook; here ``fc`` itself reads the aux layers

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def head_ND(self) -> torch.Tensor:
        return self.lm_head

    def attach(
        self, parts: TargetParts, draft_vocab_N: torch.Tensor | None = None, *, init_output: bool = False
    ) -> Eagle3Head:
        """Point the head at the target's embedding. ``draft_vocab_N``: a subset of the stored draft
        vocabulary to score (its LM-head rows are kept), or for a fresh head (``init_output``) the
        draft vocabulary itself; ``init_output`` also copies the target's final norm and those
        LM-head rows into ``norm`` and ``lm_head`` (how a head starts training)."""
        c = self.config
        if tuple(parts.embed_VD.shape) != (c.vocab_size, c.hidden_size):
            raise ValueError(
                f"target embedding has shape {tuple(parts.embed_VD.shape)}, the draft head expects "
                f"[vocab_size={c.vocab_size}, hidden_size={c.hidden_size}]: weights for another target?"
            )
        stored_N = torch.sort(self.draft_vocab_N.to(torch.long)).values
        with torch.no_grad():
            if init_output:
                vocab_N = torch.sort((stored_N if draft_vocab_N is None else draft_vocab_N).long()).values
                self.draft_vocab_N = vocab_N.to(self.device)
                self.norm.copy_(parts.norm_D.to(self.norm.dtype))
                self.lm_head.copy_(
                    parts.lm_head_VD[vocab_N.to(parts.lm_head_VD.device)].to(self.lm_head.dtype)
                )
            elif draft_vocab_N is not None:
                keep_N = torch.isin(stored_N, draft_vocab_N.to(stored_N))  # rows stay in id order
                if int(keep_N.sum()) != torch.unique(draft_vocab_N).numel():
                    raise ValueError("draft_vocab_N must be a subset of the head's stored draft vocabulary")
                self.lm_head = nn.Parameter(self.lm_head[keep_N.to(self.device)].clone(), requires_grad=False)
                self.draft_vocab_N = stored_N[keep_N].to(self.device)
            else:
                self.draft_vocab_N = stored_N.to(self.device)
        self.embed_VD = parts.embed_VD
        return self

    # --- the steps of a draft (EagleCache's interface) -----------------------------------------
    def project(self, feature_BTD: torch.Tensor, aux_BTAD: torch.Tensor | None = None) -> torch.Tensor:
        """``g = fc([a_1; …; a_A])``: the fused input state (the last-layer feature is not an input;
        ``feature_BTD`` only sets the expected shape)."""
        x_BTI = check_aux(self.config, feature_BTD, aux_BTAD)[..., : -self.config.hidden_size]
        return self.fc(x_BTI.to(self.fc.weight.dtype))

    def fuse(
        self, hidden_BTD: torch.Tensor, tokens_BT: torch.Tensor, prev_tokens_BT: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``[input_norm(embed(x_{t+1})); hidden_norm(g_t); r]`` as ``[B, T, 3D]`` (``prev_tokens_BT``
        is not an input of this layout)."""
        eps = self.norm_eps
        embed_BTD = F.embedding(tokens_BT, self.embed_VD).to(hidden_BTD.dtype)
        normed_BTD = rms_norm(hidden_BTD, self.hidden_norm, eps).to(hidden_BTD.dtype)
        residual_BTD = normed_BTD if self.config.norm_before_residual else hidden_BTD
        return torch.cat(
            [rms_norm(embed_BTD, self.input_norm, eps).to(hidden_BTD.dtype), normed_BTD, residual_BTD], dim=-1
        )

    def qkv(self, x_BTI: torch.Tensor, positions_BT: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rotated ``q [B, H, T, d]``, ``k, v [B, G, T, d]`` from the 2D attention input."""
        return rotated_heads(
            self.config, self.rope, self.qkv_proj(x_BTI[..., : 2 * self.config.hidden_size]), positions_BT
        )

    def finish(self, x_BTI: torch.Tensor, attn_BHTd: torch.Tensor) -> torch.Tensor:
        """Residual ``r`` + output projection, then the MLP: the predicted state ``ĝ [B, T, D]``."""
        B, H, T, d = attn_BHTd.shape
        h_BTD = x_BTI[..., 2 * self.config.hidden_size :] + self.o_proj(
            attn_BHTd.transpose(1, 2).reshape(B, T, H * d)
        )
        gate, up = self.gate_up_proj(rms_norm(h_BTD, self.post_norm, self.norm_eps).to(h_BTD.dtype)).chunk(
            2, -1
        )
        return h_BTD + self.down_proj(F.silu(gate) * up)

    def feature(self, h_BTD: torch.Tensor) -> torch.Tensor:
        """The predicted state is fed back as it is (no scale)."""
        return h_BTD

    def logits(self, state_BTD: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits ``[..., N]``: ``lm_head(norm(ĝ))``."""
        return F.linear(rms_norm(state_BTD, self.norm, self.norm_eps).to(self.lm_head.dtype), self.lm_head)

    def forward(
        self, hidden_BTD: torch.Tensor, tokens_BT: torch.Tensor, prev_tokens_BT: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Teacher-forced pass over whole sequences (causal, positions 0..T-1): ``ĝ_{t+1}`` for every
        pair ``(g_t, x_{t+1})``; ``hidden_BTD`` is ``g`` (:meth:`project` of the target's states)."""
        B, T, _ = hidden_BTD.shape
        positions_BT = torch.arange(T, device=hidden_BTD.device).expand(B, T)
        x = self.fuse(hidden_BTD, tokens_BT)
        q, k, v = self.qkv(x, positions_BT)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.finish(x, attn)
