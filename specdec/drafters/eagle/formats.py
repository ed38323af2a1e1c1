"""EAGLE-3 heads in the serving engines' formats: vLLM's ``speculators`` and SGLang's.

Legend: D hidden size, N draft vocabulary, V target vocabulary, A aux layers, L target layers.

Both are a directory with ``config.json`` and ``model.safetensors`` holding one EAGLE-3 layer
(:mod:`specdec.drafters.eagle.eagle3`); they differ in names and conventions (docs/formats.md):

================  =====================================  =====================================
                  speculators (vLLM)                     SGLang
================  =====================================  =====================================
config            ``speculators_model_type: "eagle3"``,  ``architectures:
                  layer dims in                          ["LlamaForCausalLMEagle3"]``, layer
                  ``transformer_layer_config``           dims at the top level
layer keys        ``layers.0.*``                         ``midlayer.*``
aux layer ids     ``eagle_aux_hidden_state_layer_ids``:  ``eagle_config.eagle_aux_hidden_state_
                  the residual stream *entering* layer   layer_ids``: the *output* of layer i
                  i (ours + 1)                           (ours)
residual          ``norm_before_residual`` (explicit)    the raw hidden state
================  =====================================  =====================================

Ours: ``EagleConfig.aux_layers`` are 0-based layer outputs; q/k/v and gate/up are fused;
the draft vocabulary is a sorted id list (``d2t``: ``target_id = i + d2t[i]``; ``t2d``: a
``[V]`` mask). Our export also writes the target's name and embedding fingerprint into the
safetensors metadata, which import checks when present.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from specdec.drafters.eagle.config import EagleConfig
from specdec.drafters.eagle.eagle3 import Eagle3Head
from specdec.drafters.eagle.headdir import (
    WEIGHTS_FILE,
    WEIGHTS_INDEX,
    check_shapes,
    draft_vocab,
    read_weights,
)
from specdec.protocols import TargetParts

__all__ = [
    "FORMATS",
    "WEIGHTS_FILE",
    "WEIGHTS_INDEX",
    "export_head",
    "export_head_file",
    "import_head",
    "detect_format",
    "unexportable",
    "check_output_dir",
]

FORMATS = ("speculators", "sglang")
_PREFIX = {"speculators": "layers.0.", "sglang": "midlayer."}
_LAYER_KEYS = {  # ours -> the formats' (under the layer prefix), split where we fuse
    "input_norm": ["input_layernorm.weight"],
    "hidden_norm": ["hidden_norm.weight"],
    "qkv_proj.weight": ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
    "o_proj.weight": ["self_attn.o_proj.weight"],
    "post_norm": ["post_attention_layernorm.weight"],
    "gate_up_proj.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "down_proj.weight": ["mlp.down_proj.weight"],
}


def _split_sizes(c: EagleConfig) -> dict[str, list[int]]:
    """Rows of each part of our fused matrices, in the order of :data:`_LAYER_KEYS`."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"qkv_proj.weight": [q, kv, kv], "gate_up_proj.weight": [c.intermediate_size] * 2}


def _check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    return fmt


def unexportable(config: EagleConfig, fmt: str) -> list[str]:
    """What of a head with ``config`` the format ``fmt`` cannot express (empty: it exports)."""
    _check_format(fmt)
    if config.layout != "eagle3":
        reasons = [
            "its layer reads fc([embed; feature]) with a bias and no input norms, while the format's "
            "EAGLE-3 layer normalises the embedding and the hidden state separately (layout "
            "'specdec'; train one with: specdec train-head --compat speculators)",
            "its input includes the last decoder layer's output (the feature), which vLLM's Llama "
            "cannot capture: it records only the residual stream entering layers 0..L-1",
        ]
        if config.prev_token_input:
            reasons.append("its previous-token input embed(x_t) has no place in the format")
        return reasons
    reasons = []
    if fmt == "sglang" and config.norm_before_residual:
        reasons.append(
            "norm_before_residual=True: SGLang's layer always keeps the raw hidden state as residual"
        )
    if fmt == "sglang" and len(config.aux_layers) != 3:
        reasons.append(f"{len(config.aux_layers)} aux layers: SGLang's fc reads exactly 3")
    return reasons


def _layer_config(c: EagleConfig) -> dict[str, Any]:
    rope = dict(c.rope_parameters)
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": rope["rope_theta"],
        "rope_scaling": None if rope.get("rope_type", "default") == "default" else rope,
        "vocab_size": c.vocab_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "max_position_embeddings": 2048,
    }


def export_head(
    head: Eagle3Head,
    fmt: str,
    out: str | Path,
    *,
    target_name: str,
    target_fingerprint: str,
    dtype: torch.dtype = torch.bfloat16,
    speculative_tokens: int = 3,
    verifier: str | None = None,
) -> Path:
    """Write ``head`` (an attached ``"eagle3"``-layout head) as a ``fmt`` directory ``out``;
    ``ValueError`` listing what the format cannot express. Returns ``out``.

    ``verifier``: the target's Hugging Face id or local directory, recorded as the speculators
    config's ``verifier.name_or_path`` (vLLM serves the head beside the model it is given; the
    ``speculators`` package loads the embedding from there)."""
    reasons = unexportable(head.config, _check_format(fmt))
    if reasons:
        raise ValueError(f"this head cannot be exported to the {fmt} format: " + "; ".join(reasons))
    from safetensors.torch import save_file

    c = head.config
    vocab_N = head.draft_vocab_N.to(torch.long).cpu()
    if not bool((vocab_N[1:] > vocab_N[:-1]).all()):
        raise ValueError("the head's draft vocabulary must be sorted by id (attach the head first)")
    out = check_output_dir(out, "out")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"out {str(out)!r}: cannot create the directory ({err.strerror})") from None
    meta = {
        "format": fmt,
        "config": json.dumps(asdict(c)),
        "target": target_name,
        "target_fingerprint": target_fingerprint,
    }
    save_file(_export_tensors(head, fmt, vocab_N, dtype), str(out / WEIGHTS_FILE), metadata=meta)
    config = _export_config(c, fmt, str(dtype).removeprefix("torch."), speculative_tokens, verifier)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def check_output_dir(out: str | Path, name: str = "out") -> Path:
    """``out`` as a Path, where a head directory can be written (it is a directory or absent);
    ``ValueError`` naming the argument ``name`` (``"--out"`` on the command line) when ``out``, or a
    folder above it, is an existing file."""
    out = Path(out)
    for p in (out, *out.parents):
        if p.exists():
            if not p.is_dir():
                what = "is an existing file" if p == out else f"lies under {str(p)!r}, an existing file"
                raise ValueError(
                    f"{name} {str(out)!r} {what}; a head is written as a directory "
                    f"(config.json + {WEIGHTS_FILE}): give a new or existing directory"
                )
            break
    return out


def _export_tensors(
    head: Eagle3Head, fmt: str, vocab_N: torch.Tensor, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The format's tensors: fc, the layer under the format's prefix (q/k/v and gate/up split), norm,
    lm_head in ``dtype``; ``d2t`` offsets and the ``t2d`` mask of the draft vocabulary ``vocab_N``."""
    c = head.config
    state = {k: v.detach().cpu() for k, v in head.state_dict().items()}
    tensors: dict[str, torch.Tensor] = {"fc.weight": state["fc.weight"], "norm.weight": state["norm"]}
    tensors["lm_head.weight"] = state["lm_head"]
    sizes = _split_sizes(c)
    for ours, theirs in _LAYER_KEYS.items():
        parts = state[ours].split(sizes[ours], dim=0) if ours in sizes else [state[ours]]
        for name, t in zip(theirs, parts, strict=True):
            tensors[_PREFIX[fmt] + name] = t
    tensors = {k: v.to(dtype).contiguous() for k, v in tensors.items()}
    tensors["d2t"] = (vocab_N - torch.arange(vocab_N.numel())).to(torch.int64)
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[vocab_N] = True
    tensors["t2d"] = t2d
    return tensors


def _export_config(
    c: EagleConfig, fmt: str, dtype_name: str, speculative_tokens: int, verifier: str | None
) -> dict[str, Any]:
    """The format's ``config.json``: speculators' (aux ids in vLLM's numbering) or SGLang's."""
    layer = _layer_config(c)
    if fmt == "speculators":
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": layer,
            "draft_vocab_size": c.draft_vocab_size,
            "norm_before_residual": c.norm_before_residual,
            "target_hidden_size": c.hidden_size,
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in c.aux_layers],
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]},
            },
            "torch_dtype": dtype_name,
        }
    return {
        **layer,
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.hidden_size,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(c.aux_layers),
            "use_aux_hidden_state": True,
        },
        "torch_dtype": dtype_name,
    }


def export_head_file(
    weights: str | Path,
    fmt: str,
    out: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    verifier: str | None = None,
) -> Path:
    """:func:`export_head` for a head file (a path or a shipped file's name), without loading its
    target: the file's target name and fingerprint carry over."""
    from specdec.drafters.eagle.weights import build_head, read_head_config, resolve_weights

    path = resolve_weights(weights)
    if path.is_dir():
        raise ValueError(f"{path} is a head directory already; export takes a head file")
    state, meta, config = read_head_config(path)
    reasons = unexportable(config, _check_format(fmt))
    if reasons:
        raise ValueError(
            f"head file {path.name} cannot be exported to the {fmt} format: " + "; ".join(reasons)
        )
    head = build_head(config, state, path)
    head.draft_vocab_N = torch.sort(head.draft_vocab_N.to(torch.long)).values  # lm_head's row order
    return export_head(
        head,
        fmt,
        out,
        target_name=meta.get("target", ""),
        target_fingerprint=meta.get("target_fingerprint", ""),
        dtype=dtype,
        verifier=verifier,
    )


def detect_format(path: str | Path) -> str:
    """``"speculators"`` or ``"sglang"`` for a head directory; ``ValueError`` otherwise."""
    config = _read_config(Path(path))
    if config.get("speculators_model_type") is not None:
        if config["speculators_model_type"] != "eagle3":
            raise ValueError(
                f"{path}: speculators_model_type {config['speculators_model_type']!r}; "
                "only 'eagle3' heads load"
            )
        return "speculators"
    if "LlamaForCausalLMEagle3" in (config.get("architectures") or []):
        return "sglang"
    raise ValueError(
        f"{path}: config.json is neither a speculators EAGLE-3 config (speculators_model_type) nor an "
        f"SGLang one (architectures LlamaForCausalLMEagle3); architectures={config.get('architectures')}"
    )


def _read_config(path: Path) -> dict[str, Any]:
    file = path / "config.json"
    if not file.is_file():
        raise ValueError(f"head directory {path}: no config.json")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{file}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(config).__name__}")
    return config


def _import_config(config: dict[str, Any], fmt: str, parts: TargetParts, path: Path) -> EagleConfig:
    """Our :class:`EagleConfig` from the format's ``config.json``; ``ValueError`` naming the file and
    the field that is missing, malformed or does not fit the target."""
    try:
        return _translate_config(config, fmt, parts, path)
    except KeyError as err:
        raise ValueError(
            f"{path / 'config.json'}: no field {err.args[0]!r}, which the {fmt} format needs"
        ) from None
    except (TypeError, ValueError) as err:
        if str(path) in str(err):  # already names the folder (a mismatch with the target)
            raise
        raise ValueError(f"{path / 'config.json'}: {err}") from None


def _translate_config(config: dict[str, Any], fmt: str, parts: TargetParts, path: Path) -> EagleConfig:
    layer = config["transformer_layer_config"] if fmt == "speculators" else config
    if not isinstance(layer, dict):
        raise ValueError(f"transformer_layer_config must be a JSON object, got {type(layer).__name__}")
    target = parts.config
    L = int(getattr(target, "num_hidden_layers", 0) or 0)
    problems = []
    for name, want in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size)):
        if layer.get(name) != want:
            problems.append(f"{name} {layer.get(name)} (the target's is {want})")
    if config.get("target_hidden_size") not in (None, layer.get("hidden_size")):
        problems.append(
            f"target_hidden_size {config['target_hidden_size']} differs from the layer's hidden_size"
        )
    if problems:
        raise ValueError(f"head {path} does not fit this target: " + "; ".join(problems))
    unsupported = [
        k
        for k in ("norm_before_fc", "fc_norm", "norm_output", "attention_bias", "mlp_bias", "bias")
        if config.get(k) or layer.get(k)
    ]
    if layer.get("num_hidden_layers", 1) != 1:
        unsupported.append(f"num_hidden_layers={layer['num_hidden_layers']}")
    if layer.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={layer['hidden_act']}")
    if unsupported:
        raise ValueError(f"head {path} uses what this engine's EAGLE-3 layer does not: {unsupported}")
    if fmt == "speculators":
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        aux = None if ids is None else [i - 1 for i in ids]  # entering layer i = output of layer i - 1
    else:
        aux = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if aux is None:  # both engines' default: the residual entering layers 2, L // 2, L - 3
        aux = [1, L // 2 - 1, L - 4]
    if any(not 0 <= i < L for i in aux):
        raise ValueError(
            f"head {path} reads target layer outputs {aux} (our 0-based numbering), but the target has "
            f"{L} layers: a head for another target?"
        )
    rope = dict(layer.get("rope_scaling") or layer.get("rope_parameters") or {})
    rope["rope_theta"] = float(rope.get("rope_theta", layer.get("rope_theta", 10000.0)))
    rope["rope_type"] = rope.pop("type", rope.get("rope_type", "default"))
    heads = layer["num_attention_heads"]
    return EagleConfig(
        layout="eagle3",
        hidden_size=layer["hidden_size"],
        intermediate_size=layer["intermediate_size"],
        num_heads=heads,
        num_kv_heads=layer.get("num_key_value_heads", heads),
        head_dim=layer.get("head_dim") or layer["hidden_size"] // heads,
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_parameters=rope,
        vocab_size=layer["vocab_size"],
        draft_vocab_size=_draft_vocab_size(config, layer["vocab_size"]),
        aux_layers=tuple(aux),
        aux_scales=(1.0,) * len(aux),
        norm_before_residual=bool(config.get("norm_before_residual", False)),
    )


def _draft_vocab_size(config: dict[str, Any], vocab_size: int) -> int:
    """``draft_vocab_size`` (absent: the whole target vocabulary), an int in [1, ``vocab_size``]."""
    N = config.get("draft_vocab_size", vocab_size)
    if isinstance(N, bool) or not isinstance(N, int) or not 1 <= N <= vocab_size:
        raise ValueError(f"draft_vocab_size must be an integer in [1, vocab_size={vocab_size}], got {N!r}")
    return N


def _format_shapes(head: Eagle3Head, fmt: str) -> dict[str, tuple[int, ...]]:
    """The format's weight tensors and their shapes for a head shaped like ``head`` (what
    :func:`_export_tensors` writes, without ``d2t`` / ``t2d``)."""
    state = head.state_dict()
    shapes = {
        k: tuple(state[ours].shape) for ours, k in (("fc.weight", "fc.weight"), ("norm", "norm.weight"))
    }
    shapes["lm_head.weight"] = tuple(state["lm_head"].shape)
    sizes = _split_sizes(head.config)
    for ours, theirs in _LAYER_KEYS.items():
        rows = sizes.get(ours, [state[ours].shape[0]])
        for name, n in zip(theirs, rows, strict=True):
            shapes[_PREFIX[fmt] + name] = (n, *state[ours].shape[1:])
    return shapes


def import_head(
    path: str | Path, parts: TargetParts, *, dtype: torch.dtype = torch.float32
) -> tuple[Eagle3Head, dict]:
    """Load a speculators- or SGLang-format head directory for the target whose tensors are
    ``parts``; returns (attached :class:`Eagle3Head`, metadata). ``ValueError`` naming the folder,
    the file and the field or tensor: which of hidden size, vocabulary, layer count or embedding
    fingerprint does not match the target, and where the directory breaks its format's contract
    (files, tensor shapes, ``d2t`` / ``t2d``; docs/formats.md)."""
    from specdec.drafters.eagle.weights import target_mismatch

    path = Path(path)
    fmt = detect_format(path)
    config = _import_config(_read_config(path), fmt, parts, path)
    state, meta, source = read_weights(path)
    reason = target_mismatch(meta, parts.embed_VD, path)
    if reason is not None:
        raise ValueError(reason)
    if "embed_tokens.weight" in state:
        embed = state.pop("embed_tokens.weight")
        if embed.shape != parts.embed_VD.shape or not torch.allclose(
            embed.float(), parts.embed_VD.float().cpu(), atol=1e-2, rtol=1e-2
        ):
            raise ValueError(
                f"head {path}: its embed_tokens differ from the target's embedding (another target?)"
            )
    head = Eagle3Head(config)
    check_shapes(state, source, _format_shapes(head, fmt), config, path)
    loaded = {
        "fc.weight": state["fc.weight"],
        "norm": state["norm.weight"],
        "lm_head": state["lm_head.weight"],
    }
    for k, theirs in _LAYER_KEYS.items():
        loaded[k] = torch.cat([state[_PREFIX[fmt] + t] for t in theirs], dim=0)
    vocab_N = draft_vocab(state, source, config, path)
    order = torch.argsort(vocab_N)  # ours: rows sorted by target id
    loaded["lm_head"] = loaded["lm_head"][order]
    loaded["draft_vocab_N"] = vocab_N[order]
    head.load_state_dict(loaded, strict=True)  # shapes checked above
    head = head.to(device=parts.embed_VD.device, dtype=dtype).eval().requires_grad_(False)
    meta = {**meta, "format": fmt, "source": str(path)}
    return head.attach(parts), meta
