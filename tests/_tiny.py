"""Tiny offline models for tests: a byte-level tokenizer and random-init Llama checkpoints (safetensors or
GGUF).

Nothing here downloads anything; a checkpoint is a few hundred KB and builds in well under a second.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from experiments.catalog.specdec_runs import byte_tokenizer  # the tiny-random target's tokenizer


def tiny_config_fields(**changes) -> dict:
    """Fields of a tiny ``transformers`` decoder config (V = 96, D = 64, F = 96, 2 layers, 4 query and 2
    key/value heads; init std 0.1, larger than the default, so the logits are far from uniform), with
    ``changes``."""
    return {
        "vocab_size": 96,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "initializer_range": 0.1,
        **changes,
    }


def tiny_llama(
    *,
    vocab_size: int = 259,
    hidden_size: int = 64,
    num_layers: int = 2,
    seed: int = 0,
    eos_token_id: int = 258,
    init_std: float = 0.02,
):
    """A random-init ``LlamaForCausalLM`` (greedy output of the default init repeats itself in places)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=257,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        initializer_range=init_std,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().eval()
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = eos_token_id
    return model


def token_data(seqs: list[list[int]], names: list[str], heldout: list[bool], *, dim: int = 8, topk: int = 4):
    """A ``FeatureData`` holding only token sequences (zero features and top-k): what code that reads
    the cache's text, not its features, needs."""
    from specdec.drafters.eagle.train.dataset import FeatureData

    lengths = torch.tensor([len(s) for s in seqs])
    total = int(lengths.sum())
    return FeatureData.join(
        tokens=torch.tensor([t for s in seqs for t in s]),
        features=torch.zeros(total, dim),
        topk_ids=torch.zeros(total, topk, dtype=torch.long),
        topk_probs=torch.zeros(total, topk),
        lengths=lengths,
        heldout=torch.tensor(heldout, dtype=torch.bool),
        names=names,
    )


def save_tiny_checkpoint(path: Path, *, tokenizer=None, **model_options) -> Path:
    """Write a tiny Llama (safetensors) and a tokenizer to ``path``; returns ``path``."""
    path = Path(path)
    tiny_llama(**model_options).save_pretrained(path, safe_serialization=True)
    (tokenizer if tokenizer is not None else byte_tokenizer()).save_pretrained(path)
    return path


# transformers' Llama state-dict names -> llama.cpp's GGUF tensor names (per layer, and the rest).
GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GGUF_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}


def llama_cpp_rotary_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order of a q or k projection (transformers' GGUF loader undoes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(
    path: Path,
    model,
    *,
    vocab: Callable,
    context_length: int,
    tied: bool = False,
    drop: tuple[str, ...] = (),
    replace: dict | None = None,
    kind: Callable | None = None,
) -> Path:
    """``model`` (a ``transformers`` Llama) as a GGUF file at ``path``, in llama.cpp's layout: its tensor
    names and its rotary row order for q and k. ``vocab(writer)`` writes the tokenizer metadata;
    ``tied`` leaves out the LM head; tensors named in ``drop`` are left out and those in ``replace``
    (GGUF name -> float array) written instead of the model's; ``kind(name, array)`` is a tensor's
    GGML type (default F32)."""
    import gguf

    Q = gguf.GGMLQuantizationType
    replace = replace or {}
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(context_length)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    vocab(w)
    names = dict(GGUF_TOP_NAMES) if tied else {**GGUF_TOP_NAMES, "lm_head.weight": "output.weight"}
    for key, value in model.state_dict().items():
        if key.startswith("model.layers."):
            layer, rest = key.removeprefix("model.layers.").split(".", 1)
            name = f"blk.{layer}.{GGUF_LAYER_NAMES[rest]}"
        elif key in names:
            name = names[key]
        else:
            continue
        if name in drop:
            continue
        a = replace.get(name, value.float().numpy())
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            a = llama_cpp_rotary_rows(a, c.num_attention_heads if "attn_q" in name else c.num_key_value_heads)
        qtype = Q.F32 if kind is None else kind(name, a)
        if qtype == Q.F32:
            w.add_tensor(name, a.astype(np.float32))
        else:
            w.add_tensor(name, gguf.quants.quantize(a.astype(np.float32), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def greedy_training_block(hf, target, num_prompts: int = 12, new_tokens: int = 40):
    """Training data for a tiny draft head: ``hf``'s greedy continuations of seeded random prompts
    (``[num_prompts, 6 + new_tokens]``) and ``target``'s forward over them (logits and features)."""
    torch.manual_seed(0)
    prompts = torch.randint(0, 256, (num_prompts, 6))
    with torch.inference_mode():
        seqs = hf.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=258,
            eos_token_id=None,
        )
        target.reset(seqs.shape[0], seqs.shape[1])
        out = target.forward(seqs, torch.zeros(seqs.shape[0], dtype=torch.long))
    return seqs, out


def fit_tiny_head(
    hf, parts, seqs, out, train_config, weights: Path, *, target_name: str, aux_BTAD=None, seed=None, **head
) -> list[dict[str, float]]:
    """Train an EAGLE head for ``hf`` (a draft vocabulary of its 200 most frequent tokens in ``seqs``;
    ``head``: more :class:`~specdec.drafters.eagle.EagleConfig` fields) for 100 AdamW steps (the
    recipe's loss under ``train_config``) on the target's greedy continuations ``seqs`` and its forward
    ``out`` over them (features, the top 4 of its logits; ``aux_BTAD``: captured layers); save it to
    ``weights``. Returns each step's losses. ``seed``: seed the head's initialisation (None: the global
    generator as it stands)."""
    from specdec.drafters.eagle import EagleConfig, EagleHead, save_eagle_head
    from specdec.drafters.eagle.train.objective import unrolled_losses

    N = 200
    # Unit-scale inputs, as the recipe sets them (the tiny target's features are ~0.03).
    config = EagleConfig.from_hf_config(
        hf.config,
        draft_vocab_size=N,
        feature_scale=1 / float(out.hidden_BTD.std()),
        embed_scale=1 / float(parts.embed_VD.std()),
        **head,
    )
    counts = torch.bincount(seqs.flatten(), minlength=259)
    vocab = torch.argsort(counts, descending=True, stable=True)[:N]
    if seed is not None:
        torch.manual_seed(seed)
    head = EagleHead(config)
    head.draft_vocab_N = vocab
    head.attach(parts)
    vocab_index = torch.full((259,), -1, dtype=torch.long)
    vocab_index[head.draft_vocab_N] = torch.arange(N)
    top_p, top_i = torch.softmax(out.logits_BTV.clone(), -1).topk(4, dim=-1)
    batch = {
        "features": out.hidden_BTD.clone(),
        "tokens": seqs.clone(),
        "topk_ids": top_i,
        "topk_probs": top_p,
        "valid": torch.ones_like(seqs, dtype=torch.bool),
    }
    if aux_BTAD is not None:
        batch["aux"] = aux_BTAD.clone()
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    history = []
    for _ in range(100):
        losses = unrolled_losses(head, batch, vocab_index, train_config, 1 / config.feature_scale)
        opt.zero_grad()
        losses["loss"].backward()
        opt.step()
        history.append({k: float(v.detach()) for k, v in losses.items()})
    head.draft_vocab_N = vocab  # frequency order, as the recipe saves it
    save_eagle_head(head, weights, target_name=target_name, embed_VD=parts.embed_VD)
    return history


class TableTarget:
    """A batched toy :class:`specdec.protocols.Target`: a trigram model given by a logits table.

    The logits after token ``x_j`` are ``table_VVV[x_{j-1}, x_j]`` (``x_{-1}`` = 0). It checks the
    cache protocol strictly: a block may start only at or before a row's valid length, so a loop
    that skips a token, or forgets to roll back, fails loudly.
    """

    def __init__(self, table_VVV: torch.Tensor, *, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.table_VVV = table_VVV.float()
        self.vocab_size = table_VVV.shape[-1]
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = torch.device("cpu")
        self.num_forwards = 0

    def reset(self, batch_size: int, max_len: int) -> None:
        self.tokens_BL = torch.zeros((batch_size, max_len), dtype=torch.long)
        self.valid_B = torch.zeros(batch_size, dtype=torch.long)

    def _rows(self, rows_B, B):
        if rows_B is None:
            return torch.arange(B)
        rows = torch.as_tensor(rows_B).long().reshape(-1)
        assert rows.shape == (B,) and len(set(rows.tolist())) == B, f"bad rows_B {rows.tolist()}"
        return rows

    def forward(self, tokens_BT, start_B, *, rows_B=None, logits_index_BN=None):
        from specdec.protocols import TargetOutput

        B, T = tokens_BT.shape
        rows = self._rows(rows_B, B)
        if bool((start_B > self.valid_B[rows]).any()):
            valid = self.valid_B[rows].tolist()
            raise AssertionError(f"block starts {start_B.tolist()} past the valid cache {valid}")
        pos_BT = start_B.unsqueeze(1) + torch.arange(T)
        capacity = self.tokens_BL.shape[1]
        if int(pos_BT.max()) >= capacity:
            raise AssertionError(f"block reaches slot {int(pos_BT.max())}, capacity {capacity}")
        rows_B1 = rows.unsqueeze(1)
        self.tokens_BL[rows_B1, pos_BT] = tokens_BT
        prev_BT = torch.where(pos_BT > 0, self.tokens_BL[rows_B1, (pos_BT - 1).clamp(min=0)], 0)
        logits_BTV = self.table_VVV[prev_BT, tokens_BT]
        self.valid_B[rows] = start_B + T
        self.num_forwards += 1
        if logits_index_BN is not None:
            logits_BTV = logits_BTV.gather(1, logits_index_BN.unsqueeze(-1).expand(-1, -1, self.vocab_size))
        return TargetOutput(logits_BTV=logits_BTV)

    def rollback(self, lengths_B, rows_B=None) -> None:
        rows = self._rows(rows_B, lengths_B.shape[0])
        if bool((lengths_B > self.valid_B[rows]).any()):
            valid = self.valid_B[rows].tolist()
            raise AssertionError(f"rollback to {lengths_B.tolist()} beyond the valid cache {valid}")
        self.valid_B[rows] = lengths_B.clone()

    def next_probs(self, prefix: list[int], **sampling) -> torch.Tensor:
        """The processed next-token distribution after ``prefix`` (the exact reference)."""
        from specdec.sampling import logits_to_probs

        prev = prefix[-2] if len(prefix) >= 2 else 0
        return logits_to_probs(self.table_VVV[prev, prefix[-1]], **sampling)


def random_table(vocab_size: int, *, seed: int, scale: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((vocab_size, vocab_size, vocab_size), generator=g) * scale
