"""The native target on a device, in a dtype: bf16 / fp16 storage, GGUF rows dequantised on the device,
index tensors built on the device, and the combinations that are refused.

Legend: B batch, T block length, V vocabulary.

There is no GPU here, so the device side is checked on ``torch.device("meta")``: a target built
there runs its forward through the same code as on CUDA (the PyTorch backends), every op's tensors
are recorded and must all live on the target's device (a CPU index tensor that CUDA would copy in
every layer shows up as a CPU argument), and any read-back (``.item()``, ``.tolist()``, ``.cpu()``)
of a device tensor fails, as a meta tensor holds no data.
"""

from __future__ import annotations

import pytest
import torch
from _tiny import tiny_config_fields
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.quant import quantize_int4, quantize_int8
from specdec.targets.linear import PackedLinear, resolve_backend
from specdec.targets.llama import LlamaTarget
from specdec.targets.llama_config import LlamaConfig
from specdec.targets.placement import resolve_placement

VOCAB = 96


@pytest.fixture(scope="module")
def tiny():
    """A tiny Llama (untied head) and a Qwen3 (q/k norms, tied): configs and float32 states."""
    import transformers

    common = tiny_config_fields(vocab_size=VOCAB)
    out = {}
    for name, hf_config in {
        "llama": transformers.LlamaConfig(**common, tie_word_embeddings=False, attention_bias=True),
        "qwen3": transformers.Qwen3Config(**common, tie_word_embeddings=True, head_dim=32),
    }.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(hf_config).float().eval()
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if hf_config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        out[name] = (LlamaConfig.from_hf(hf_config), state)
    return out


def _target(tiny, family="llama", **kw) -> LlamaTarget:
    config, state = tiny[family]
    return LlamaTarget(config, state, **kw)


def _weight_tensors(target: LlamaTarget) -> list[torch.Tensor]:
    lins = [lin for ly in target.layers for lin in (ly.qkv, ly.o, ly.gate_up, ly.down)] + [target._head]
    return [lin._weight_OI() for lin in lins] + [target.embed_tokens.weight]


def _decode(target: LlamaTarget, prompt_BT: torch.Tensor, forced_BS: torch.Tensor | None, steps: int):
    """Greedy decoding one token a forward through the cache: the argmax of every step ``[B, S]``;
    with ``forced_BS`` the next input is that token (teacher forcing), not the argmax."""
    B, T = prompt_BT.shape
    target.reset(B, T + steps + 1)
    out = target.forward(prompt_BT, torch.zeros(B, dtype=torch.long))
    picks = []
    for s in range(steps):
        picks.append(out.logits_BTV[:, -1].argmax(-1))
        fed_B = picks[-1] if forced_BS is None else forced_BS[:, s]
        out = target.forward(fed_B[:, None], torch.full((B,), T + s, dtype=torch.long))
    return torch.stack(picks, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes_store_weights_and_cache_as_such_and_stay_close(tiny, dtype):
    """``dtype=`` on the PyTorch backend (what runs on a GPU): every weight matrix and the KV cache
    are stored in the dtype (half the bytes of float32), the embedding table too (the float32 values
    rounded once: no float32 copy of the vocabulary), and the logits stay within a half-precision
    tolerance of the float32 target's, greedy output agreeing mostly."""
    fp32 = _target(tiny, linear_backend="reference")
    half = _target(tiny, linear_backend="reference", dtype=dtype)
    assert half.dtype == dtype and half.weights == {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    assert all(w.dtype == dtype for w in _weight_tensors(half))  # the embedding's last
    assert all(w.dtype == torch.float32 for w in _weight_tensors(fp32))
    assert torch.equal(half.embed_tokens.weight, fp32.embed_tokens.weight.to(dtype))
    assert half.weight_bytes * 2 == fp32.weight_bytes
    prompt = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    for t in (fp32, half):
        t.reset(2, 32)
    assert half.cache.k_NBHLD.dtype == dtype and half.cache.v_NBHLD.dtype == dtype
    assert half.cache.k_NBHLD.nbytes * 2 == fp32.cache.k_NBHLD.nbytes
    ref = fp32.forward(prompt, torch.zeros(2, dtype=torch.long)).logits_BTV
    got = half.forward(prompt, torch.zeros(2, dtype=torch.long)).logits_BTV
    assert got.dtype == torch.float32  # the protocol's logits, whatever the compute dtype
    tol = 0.05 * float(ref.abs().max())
    assert float((got - ref).abs().max()) < tol
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8
    greedy_ref = _decode(fp32, prompt, None, 10)
    greedy_half = _decode(half, prompt, greedy_ref, 10)  # the same inputs: each step's pick compared
    assert (greedy_half == greedy_ref).float().mean() >= 0.8  # a near tie may flip, not the run


def test_bf16_format_alone_keeps_the_packed_cpu_path(tiny):
    """``weights='bf16'`` without a dtype on a CPU: bf16 weights on the packed kernels, float32
    activations and cache (the fast CPU path); ``dtype=bfloat16`` picks PyTorch ops in bf16."""
    packed = resolve_backend("auto", "cpu")
    t = _target(tiny, weights="bf16")
    assert t.linear_backend == packed and t.dtype == torch.float32
    t.reset(1, 8)
    assert t.cache.k_NBHLD.dtype == torch.float32
    assert _target(tiny, dtype=torch.bfloat16).linear_backend == "reference"


def test_quantised_rows_are_dequantised_on_the_device_into_the_dtype():
    """GGUF-style rows on a PyTorch backend: moved to the device packed, dequantised there, into the
    asked dtype (the weight equals the CPU dequantisation, rounded to it)."""
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(2))
    for rows in (quantize_int8(w), quantize_int4(w, 32)):
        on_cpu = PackedLinear(rows, backend="reference", dtype=torch.bfloat16)
        assert torch.equal(on_cpu.weight_float(), rows.dequantize().to(torch.bfloat16).float())
        on_dev = PackedLinear(rows, backend="reference", dtype=torch.bfloat16, device="meta")
        assert on_dev._weight_OI().device.type == "meta" and on_dev._weight_OI().dtype == torch.bfloat16
        assert on_dev.nbytes == 40 * 64 * 2


class _DeviceLog(TorchDispatchMode):
    """Ops that mix device tensors with host tensors (0-dim host scalars aside, which any device
    takes): on CUDA each is a host-to-device copy. Host-only ops (bookkeeping) are fine."""

    def __init__(self) -> None:
        super().__init__()
        self.host_args: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = [*args, *kwargs.values()]
        flat += [t for a in list(flat) if isinstance(a, (list, tuple)) for t in a]
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        if any(a.device.type == "meta" for a in tensors):
            for a in tensors:
                if a.device.type != "meta" and a.dim() > 0:
                    self.host_args.append(f"{func}: {tuple(a.shape)} on {a.device}")
        return func(*args, **kwargs)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, None])
def test_forward_on_a_device_builds_every_index_there_and_reads_nothing_back(tiny, family, dtype):
    """A target on ``meta`` (standing in for CUDA): prefill, ragged decode over a subset of rows,
    a tree block, copy_slots and logits_index_BN all run with every op's tensors on the device, and
    nothing is read back from it (a meta tensor cannot be). Inputs come from the host, as the
    engine's bookkeeping does."""
    target = _target(tiny, family, device="meta", dtype=dtype)
    assert target.linear_backend == "reference"
    assert target.dtype == (dtype or torch.float32)  # fp32 weights keep float32 unless asked
    assert all(w.device.type == "meta" for w in _weight_tensors(target))
    target.reset(3, 40)
    assert target.cache.k_NBHLD.device.type == "meta" and target.cache.k_NBHLD.dtype == target.dtype
    log = _DeviceLog()
    with log:
        out = target.forward(torch.randint(0, VOCAB, (3, 7)), torch.zeros(3, dtype=torch.long))
        assert out.logits_BTV.device.type == "meta" and out.logits_BTV.shape == (3, 7, VOCAB)
        out = target.forward(
            torch.tensor([[5], [6]]),
            torch.tensor([7, 5]),
            rows_B=torch.tensor([2, 0]),
            logits_index_BN=torch.tensor([[0], [0]]),
        )
        assert out.logits_BTV.shape == (2, 1, VOCAB) and out.hidden_BTD.device.type == "meta"
        mask = torch.ones(4, 4, dtype=torch.bool).tril()
        mask[2, 1] = False
        depth = torch.tensor([0, 1, 1, 2])
        target.forward(
            torch.randint(0, VOCAB, (3, 4)), torch.tensor([6, 7, 8]), tree_mask_TT=mask, depth_T=depth
        )
        target.copy_slots(torch.tensor([[6, 8], [7, 8], [8, 10]]), torch.tensor([6, 7, 8]))
        target.rollback(torch.tensor([8, 9, 10]))
        target.forward_layers(torch.tensor([[1], [2], [3]]), torch.tensor([8, 9, 10]), num_layers=1)
    assert log.host_args == [], "host tensors reached device ops:\n" + "\n".join(log.host_args[:10])


def test_default_compute_dtype_per_format_and_device():
    """What ``dtype=None`` means: the float format's own dtype; quantised rows in float32 on a CPU
    and bfloat16 on an accelerator; the packed kernels always float32."""
    cpu, dev = torch.device("cpu"), torch.device("meta")
    assert resolve_placement("fp32", None, dev, "reference") == ("fp32", torch.float32)
    assert resolve_placement("bf16", None, dev, "reference") == ("bf16", torch.bfloat16)
    assert resolve_placement("fp32", torch.float16, dev, "reference") == ("fp16", torch.float16)
    assert resolve_placement("gguf", None, dev, "reference") == ("gguf", torch.bfloat16)
    assert resolve_placement("gguf", None, cpu, "reference") == ("gguf", torch.float32)
    assert resolve_placement("gguf", torch.float16, dev, "reference") == ("gguf", torch.float16)
    assert resolve_placement("bf16", None, cpu, "packed") == ("bf16", torch.float32)
    assert resolve_placement("gguf-q8", None, cpu, "packed") == ("gguf-q8", torch.float32)


@pytest.mark.parametrize(
    "weights, dtype, device, backend, match",
    [
        (
            "gguf-q8",
            None,
            "meta",
            "auto",
            r"weights='gguf-q8'.*8-bit activations run on the CPU.*weights='gguf'",
        ),
        ("int4-q8", None, "meta", "auto", r"weights='int4-q8'.*weights='int4'"),
        ("gguf-q8", torch.bfloat16, "cpu", "auto", r"8-bit activations compute in float32"),
        ("fp32", None, "meta", "packed", r"'packed' runs on the CPU"),
        ("int4", None, "meta", "packed", r"'packed' runs on the CPU"),
        ("fp32", torch.bfloat16, "cpu", "packed", r"'packed' computes in float32"),
        ("fp16", None, "cpu", "packed", r"'packed' stores float weights as fp32 or bf16"),
        ("fp32", torch.float64, "cpu", "reference", r"dtype must be one of float32, bfloat16, float16"),
    ],
)
def test_unsupported_combinations_are_named(tiny, weights, dtype, device, backend, match):
    with pytest.raises(ValueError, match=match):
        _target(tiny, weights=weights, dtype=dtype, device=device, linear_backend=backend)


def test_qself_copy_runs_in_the_targets_dtype_and_device(tiny):
    """``qself``'s requantised copy of a bf16 target on the PyTorch backend computes in bf16 too (it
    shares the target's embedding and norms): its cache is bf16, and a forward runs."""
    from specdec.drafters.qself import qself

    target = _target(tiny, dtype=torch.bfloat16)
    draft = qself(target, weights="int8").draft
    assert draft.dtype == torch.bfloat16 and draft.device == target.device and draft.weights == "int8"
    draft.reset(1, 16)
    assert draft.cache.k_NBHLD.dtype == torch.bfloat16
    out = draft.forward(torch.tensor([[1, 2, 3]]), torch.tensor([0]))
    assert out.logits_BTV.dtype == torch.float32 and torch.isfinite(out.logits_BTV).all()
