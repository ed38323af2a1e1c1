"""The native target's weights: a checkpoint's tensors, fused and packed in the chosen weight format.

Legend: D model dim, V vocabulary, H query heads, J key/value heads, E head dim.

Weight formats (``weights=`` on :func:`specdec.targets.load_target`, ``--weights`` on the CLI):

- ``fp32``: the checkpoint's weights in float32;
- ``bf16``: the linear layers in bfloat16 (half the bytes; outputs change slightly);
- ``fp16``: the linear layers in float16 (PyTorch backends only: a GPU, or ``reference`` on a CPU);
- ``gguf``: the GGUF file's own tensors (``Q4_0`` / ``Q4_1`` / ``Q8_0``), kept quantised and
  dequantised in registers: the same function as the float32 model dequantised from that file, which
  is what ``transformers`` loads, up to float accumulation order;
- ``int8``: every linear layer and the LM head quantised per output channel to int8;
- ``int4``: every linear layer and the LM head quantised to int4 in groups of 32 inputs, with
  scales and zero points;
- ``gguf-q8``, ``int8-q8``, ``int4-q8``: the same weights with **8-bit activations** (each product's
  input quantised per row in blocks of 32, integer dot products: ``kernels/csrc/q8_gemm.c``), LM head
  included. Another function than the float model (close to it), and batch invariant: a token's
  logits are bitwise the same at T = 1, inside a verify block and beside other rows, so speculative
  decoding reproduces plain decoding of this target exactly. ``gguf-q8`` runs only the file's
  ``Q4_0`` / ``Q4_1`` / ``Q8_0`` matrices: a float matrix is a ``ValueError`` naming it.

The layers fuse q|k|v and gate|up into one product each (quantised rows concatenate as they are).
The embedding table is stored as the float matrices are: in the format's dtype for ``bf16`` /
``fp16``, else in the compute dtype (dequantised once for ``gguf``; float32 on the packed kernels),
so a half-precision model holds no float32 copy of its vocabulary, and a tied LM head is the table
itself. The norms and biases stay float32 (a few kB; the packed kernels read them so). A checkpoint
still in its file (:class:`specdec.targets.safetensors_state.StoredTensor`) is read tensor by tensor
straight into the stored dtype, so a load peaks near the model's final size. Which format runs on
which device, in which dtype: :mod:`specdec.targets.placement`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kernels.llama_forward import LayerSpec, LinearSpec, NativeDecoder, native_forward_available
from kernels.q8_reference import ACT8_BLOCK
from kernels.quant import GGUF_KINDS, QuantizedRows, quantize_int4, quantize_int8
from specdec.targets.checkpoint_contract import check_checkpoint, describe_tensor
from specdec.targets.linear import PackedLinear
from specdec.targets.llama_config import LlamaConfig
from specdec.targets.placement import FLOAT_FORMATS
from specdec.targets.safetensors_state import CHUNK_BYTES, StoredTensor

__all__ = [
    "WEIGHT_MODES",
    "GGUF_MODES",
    "INT4_GROUP_SIZE",
    "LayerWeights",
    "ModelWeights",
    "build_weights",
    "save_packed",
    "load_packed",
    "requantized",
    "packed_cache_path",
    "native_decoder",
]

WEIGHT_MODES = ("fp32", "bf16", "fp16", "gguf", "int8", "int4", "gguf-q8", "int8-q8", "int4-q8")
GGUF_MODES = ("gguf", "gguf-q8")
"""The formats that read a GGUF file's own quantised blocks."""
INT4_GROUP_SIZE = 32
PACKED_CACHE_FORMAT = 2
"""Version of the packed-weight cache's contents (2: a ``bf16`` model's embedding stored in bfloat16)."""


@dataclass
class LayerWeights:
    """One decoder layer's weights, fused for the hot loop (``PackedLinear`` = norm → linear → + residual)."""

    qkv: PackedLinear  # RMSNorm(input_layernorm), then D -> (H + 2J)·E
    qk_norm: torch.Tensor | None  # [H + J, E] (Qwen3), else None
    o: PackedLinear  # H·E -> D, + residual
    gate_up: PackedLinear  # RMSNorm(post_attention_layernorm), then D -> 2F
    down: PackedLinear  # silu(gate)·up, then F -> D, + residual


@dataclass
class ModelWeights:
    """Every layer, the embedding (in the float weights' storage dtype), the float32 final norm, and
    the LM head (float or quantised)."""

    layers: list[LayerWeights]
    embed_VD: torch.Tensor
    norm_D: torch.Tensor
    head_weight: Any  # float [V, D], QuantizedRows or PackedWeight
    head: PackedLinear  # final norm + LM head
    tied: bool  # the LM head is the embedding
    compute_dtype: torch.dtype = torch.float32  # what the products were built to run in

    def head_VD(self) -> torch.Tensor:
        """The LM head as ``[V, D]`` on the embedding's device: the embedding itself when tied, a float
        head as it is stored (no float32 copy of a bf16 head), quantised rows dequantised to float32."""
        if self.tied:
            return self.embed_VD
        w = self.head_weight
        w = w if isinstance(w, torch.Tensor) else w.dequantize()
        return w.to(device=self.embed_VD.device)

    @property
    def nbytes(self) -> int:
        """Bytes of weights one single-token forward streams (every layer's products and the head)."""
        lins = [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return sum(lin.nbytes for lin in lins) + self.head.nbytes


class _State:
    """Takes tensors out of a checkpoint state by name, converting formats as the mode asks."""

    def __init__(self, state: dict[str, Any], weights: str, device: torch.device) -> None:
        if weights not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {weights!r}")
        self.state, self.weights, self.device, self.source = dict(state), weights, device, state
        # float matrices go to the device once, in the format's dtype (never a float32 copy of a
        # bf16 model there); int8 / int4 quantise from float32
        self.matrix_dtype = FLOAT_FORMATS.get(weights, torch.float32)
        self.base, self.act8 = weights.removesuffix("-q8"), weights.endswith("-q8")  # act8: 8-bit activations
        self.scratch: torch.Tensor | None = None  # one read buffer for every stored tensor converted
        if self.act8 and device.type != "cpu":
            raise ValueError(f"weights={weights!r} (8-bit activations) runs on the CPU, got device {device}")
        quantised = [k for k, v in self.state.items() if isinstance(v, QuantizedRows)]
        if quantised and weights not in GGUF_MODES:
            raise ValueError(
                f"the state holds quantised GGUF tensors (e.g. {quantised[0]!r}); load it with weights='gguf'"
            )

    def float(self, key: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Tensor ``key`` on the device in ``dtype`` (quantised rows dequantised first)."""
        value = self.state.pop(key)
        if isinstance(value, StoredTensor):  # read straight into dtype, chunk by chunk
            return value.load(dtype, self.device, self.read_scratch())
        if isinstance(value, QuantizedRows):
            value = value.dequantize()
        return value.to(device=self.device, dtype=dtype).contiguous()

    def read_scratch(self) -> torch.Tensor:
        """The buffer stored tensors are read through when converted (allocated once, on first use)."""
        if self.scratch is None:
            self.scratch = torch.empty(CHUNK_BYTES, dtype=torch.uint8)
        return self.scratch

    def maybe(self, key: str, wanted: bool) -> torch.Tensor | None:
        return self.float(key) if wanted else None

    def matrix(self, *keys: str) -> torch.Tensor | QuantizedRows:
        """The rows of ``keys`` stacked (one fused product), in the mode's format."""
        parts = [self.state.pop(k) for k in keys]
        for k, p in zip(keys, parts, strict=True):
            self.check_runnable(k, p)
        if all(isinstance(p, QuantizedRows) for p in parts):
            return QuantizedRows.cat(parts)
        if any(isinstance(p, QuantizedRows) for p in parts):
            raise ValueError(f"{keys}: some of these GGUF tensors are quantised and some are not")
        # each part read or copied into its rows of the fused matrix: no float32 copy of a bf16 one
        rows = [p.shape[0] for p in parts]
        w = torch.empty(sum(rows), parts[0].shape[1], dtype=self.matrix_dtype, device=self.device)
        for p, w_part in zip(parts, w.split(rows), strict=True):
            if isinstance(p, StoredTensor):
                p.read_into(w_part, self.read_scratch())
            else:
                w_part.copy_(p)
        return self.quantise(w)

    def quantise(self, w: torch.Tensor | QuantizedRows) -> torch.Tensor | QuantizedRows:
        if isinstance(w, QuantizedRows) or self.base not in ("int8", "int4"):
            return w
        return quantize_int8(w) if self.base == "int8" else quantize_int4(w, INT4_GROUP_SIZE)

    def check_runnable(self, key: str, value: Any) -> None:
        """``ValueError`` for a matrix the 8-bit-activation kernels cannot run as stored: a float GGUF
        matrix under ``gguf-q8`` (nothing is quantised behind the user's back), or rows whose inputs
        are not a multiple of the activation block."""
        if not self.act8:
            return
        if self.weights == "gguf-q8" and not isinstance(value, QuantizedRows):
            raise ValueError(
                f"{describe_tensor(self.source, key)} has a float type (F32, F16 or BF16), which "
                f"weights='gguf-q8' cannot run: its products need {', '.join(GGUF_KINDS)} blocks "
                "(use weights='gguf')"
            )
        inputs = value.shape[1]
        if inputs % ACT8_BLOCK:
            raise ValueError(
                f"{describe_tensor(self.source, key)} has {inputs} inputs; weights={self.weights!r} "
                f"needs a multiple of {ACT8_BLOCK}"
            )


def build_weights(
    config: LlamaConfig,
    state: dict[str, Any],
    *,
    weights: str,
    backend: str,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> ModelWeights:
    """Fuse and pack a checkpoint's tensors on ``device``, after holding every one to the config
    (:func:`specdec.targets.checkpoint_contract.check_checkpoint`: ``ValueError`` naming the file, the
    tensor, its shape and the expected one, or a missing or unused tensor). ``dtype``: the compute
    dtype (:func:`specdec.targets.placement.resolve_placement`): what quantised rows are dequantised
    into on the PyTorch backends; float matrices and the embedding are stored in the format's dtype.
    Tensors are read (or converted) one at a time, the state's own let go as they are used."""
    c, s = config, _State(state, weights, device)
    check_checkpoint(config, state)
    storage = FLOAT_FORMATS.get(weights, dtype)  # float matrices in the format's dtype, rows into dtype
    pack = lambda w, b=None, **kw: PackedLinear(
        w, b, backend=backend, dtype=storage, device=device, act8=s.act8, **kw
    )
    eps = c.rms_norm_eps
    embed_key = "model.embed_tokens.weight"
    tied = "lm_head.weight" not in state  # the contract allows it only with tie_word_embeddings
    quantised_tied = tied and s.base in ("int8", "int4")
    if quantised_tied:  # the head quantised from the float32 table, as the checkpoint holds it
        s.check_runnable(embed_key, state[embed_key])
        embed = s.float(embed_key)
        head_w = s.quantise(embed)
        embed = embed.to(storage)
    else:
        embed = s.float(embed_key, storage)
    layers = []
    for i in range(c.num_layers):
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        qkv_b = torch.cat([s.float(a + f"{n}_proj.bias") for n in "qkv"]) if c.qkv_bias else None
        qk_norm = None
        if c.qk_norm:
            qn, kn = s.float(a + "q_norm.weight"), s.float(a + "k_norm.weight")
            qk_norm = torch.cat([qn.expand(c.num_heads, -1), kn.expand(c.num_kv_heads, -1)])
        gate_up_b = (
            torch.cat([s.float(m + "gate_proj.bias"), s.float(m + "up_proj.bias")]) if c.mlp_bias else None
        )
        layers.append(
            LayerWeights(
                qkv=pack(
                    s.matrix(*(a + f"{n}_proj.weight" for n in "qkv")),
                    qkv_b,
                    norm_weight_I=s.float(p + "input_layernorm.weight"),
                    norm_eps=eps,
                ),
                qk_norm=qk_norm,
                o=pack(s.matrix(a + "o_proj.weight"), s.maybe(a + "o_proj.bias", c.o_bias)),
                gate_up=pack(
                    s.matrix(m + "gate_proj.weight", m + "up_proj.weight"),
                    gate_up_b,
                    norm_weight_I=s.float(p + "post_attention_layernorm.weight"),
                    norm_eps=eps,
                ),
                down=pack(
                    s.matrix(m + "down_proj.weight"),
                    s.maybe(m + "down_proj.bias", c.mlp_bias),
                    swiglu=True,
                ),
            )
        )
    norm_w = s.float("model.norm.weight")
    if not tied:
        head_w = s.matrix("lm_head.weight")
    elif not quantised_tied:
        s.check_runnable(embed_key, state[embed_key])
        head_w = s.quantise(state[embed_key] if weights in GGUF_MODES else embed)
    head = pack(head_w, norm_weight_I=norm_w, norm_eps=eps)
    return ModelWeights(layers, embed, norm_w, head_w, head, tied, dtype)


# --- a cache of packed weights ----------------------------------------------------------------------
_LINEARS = ("qkv", "o", "gate_up", "down")


def _linear_record(prefix: str, lin: PackedLinear, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    w = lin.packed_weight
    tensors[prefix + ".data"] = w.data
    for name in ("bias_O", "norm_weight_I"):
        if getattr(lin, name) is not None:
            tensors[f"{prefix}.{name}"] = getattr(lin, name)
    return {
        "fmt": w.fmt,
        "O": w.out_features,
        "I": w.in_features,
        "G": w.group_size,
        "isa": w.isa,
        "eps": lin.norm_eps,
        "swiglu": lin.swiglu,
    }


def save_packed(weights: ModelWeights, path: Any, key: str) -> None:
    """Write the packed weights (``packed`` backend only) to a safetensors file (atomically)."""
    import json
    import os

    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {"embed_VD": weights.embed_VD, "norm_D": weights.norm_D}
    meta: dict[str, Any] = {
        "head": _linear_record("head", weights.head, tensors),
        "layers": [],
        "tied": weights.tied,
    }
    for i, layer in enumerate(weights.layers):
        meta["layers"].append({n: _linear_record(f"L{i}.{n}", getattr(layer, n), tensors) for n in _LINEARS})
        if layer.qk_norm is not None:
            tensors[f"L{i}.qk_norm"] = layer.qk_norm
    tmp = f"{path}.tmp{os.getpid()}"
    save_file(
        {k: v.clone() for k, v in tensors.items()},  # clones: shared storage (a tied norm) saves apart
        tmp,
        metadata={"key": key, "layout": json.dumps(meta)},
    )
    os.replace(tmp, path)


def load_packed(path: Any, key: str) -> ModelWeights | None:
    """The weights :func:`save_packed` wrote under ``key`` (None when the file is missing or stale)."""
    import json

    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    from kernels.packed_gemm import PackedWeight

    try:
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("key") != key:
                return None
            meta = json.loads(f.metadata()["layout"])
        t = load_file(str(path))
    except (OSError, SafetensorError, ValueError, KeyError):
        return None

    def linear(prefix: str, r: dict[str, Any]) -> PackedLinear:
        w = PackedWeight(r["fmt"], r["O"], r["I"], r["G"], r["isa"], t[prefix + ".data"])
        return PackedLinear(
            w,
            t.get(prefix + ".bias_O"),
            "packed",
            norm_weight_I=t.get(prefix + ".norm_weight_I"),
            norm_eps=r["eps"],
            swiglu=r["swiglu"],
        )

    try:  # a record whose bytes do not match its sizes (PackedWeight checks them) is stale too
        layers = [
            LayerWeights(qk_norm=t.get(f"L{i}.qk_norm"), **{n: linear(f"L{i}.{n}", rec[n]) for n in _LINEARS})
            for i, rec in enumerate(meta["layers"])
        ]
        head = linear("head", meta["head"])
    except (ValueError, KeyError, TypeError):
        return None
    return ModelWeights(layers, t["embed_VD"], t["norm_D"], head.packed_weight, head, meta["tied"])


def requantized(weights: ModelWeights, mode: str, *, backend: str) -> ModelWeights:
    """A copy of float weights in another format (``int8`` or ``int4``): every product's weight
    dequantised to float32 and quantised again; the embedding and norms are shared."""
    if mode not in ("int8", "int4"):
        raise ValueError(f"mode must be 'int8' or 'int4', got {mode!r}")

    def copy(lin: PackedLinear) -> PackedLinear:
        w = lin.packed_weight.dequantize() if hasattr(lin, "packed_weight") else lin.weight_float()
        q = quantize_int8(w) if mode == "int8" else quantize_int4(w, INT4_GROUP_SIZE)
        return PackedLinear(
            q,
            lin.bias_O,
            backend=backend,
            dtype=lin.dtype,
            device=lin.device,
            norm_weight_I=lin.norm_weight_I,
            norm_eps=lin.norm_eps,
            swiglu=lin.swiglu,
        )

    layers = [
        LayerWeights(
            qkv=copy(ly.qkv), qk_norm=ly.qk_norm, o=copy(ly.o), gate_up=copy(ly.gate_up), down=copy(ly.down)
        )
        for ly in weights.layers
    ]
    head = copy(weights.head)
    return ModelWeights(
        layers,
        weights.embed_VD,
        weights.norm_D,
        head.packed_weight if hasattr(head, "packed_weight") else weights.head_weight,
        head,
        weights.tied,
        weights.compute_dtype,
    )


def packed_cache_path(path: Path, source: Path | None, weights: str, backend: str) -> tuple[Path | None, str]:
    """Where the packed weights of a checkpoint are cached, and the key that must match (None: not
    cached: a linear backend other than ``packed``). The key names the weight files (resolved path,
    size and modification time), a hash of ``config.json`` (the norm epsilon and the head counts are
    baked into the packed layers), the weight format, the ISA path, the int4 group size, the kernel's
    source and :data:`PACKED_CACHE_FORMAT`."""
    import hashlib

    from kernels.native import cache_root, cpu_isa
    from kernels.packed_gemm import source_digest

    if backend != "packed":
        return None, ""
    files = [source] if source is not None else sorted(path.glob("*.safetensors"))
    stamp = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    config_file = path / "config.json"
    config_sha = hashlib.sha256(config_file.read_bytes() if config_file.is_file() else b"").hexdigest()
    isa = cpu_isa()
    parts = (stamp, config_sha, weights, isa, INT4_GROUP_SIZE, source_digest(), PACKED_CACHE_FORMAT)
    key = hashlib.sha256(repr(parts).encode())
    digest = key.hexdigest()[:16]
    return cache_root() / "packed" / f"{path.name}-{weights}-{isa}-{digest}.safetensors", digest


def native_decoder(weights: ModelWeights, config: LlamaConfig) -> NativeDecoder | None:
    """The native forward over the packed weights (None when it does not build here)."""
    if not native_forward_available():
        return None

    def spec(lin: Any) -> LinearSpec:
        return LinearSpec(lin.packed_weight, lin.bias_O, lin.norm_weight_I, lin.norm_eps, lin.swiglu)

    layers = [
        LayerSpec(spec(ly.qkv), spec(ly.o), spec(ly.gate_up), spec(ly.down), ly.qk_norm)
        for ly in weights.layers
    ]
    return NativeDecoder(
        layers,
        heads=config.num_heads,
        kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        eps=config.rms_norm_eps,
    )
