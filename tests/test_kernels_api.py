"""kernels public API: input validation, backend selection and its environment overrides, custom-op
registration (opcheck, torch.compile tracing), and the import rules (triton optional and confined)."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import kernels

REPO = pathlib.Path(__file__).resolve().parents[1]
GG_ENV, ROUTING_ENV = "SPECDEC_GROUPED_GEMM_BACKEND", "SPECDEC_ROUTING_BACKEND"


@pytest.fixture(autouse=True)
def _no_backend_override(monkeypatch):
    monkeypatch.delenv(GG_ENV, raising=False)
    monkeypatch.delenv(ROUTING_ENV, raising=False)


def _gg_inputs():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(6, 4, generator=gen), torch.randn(3, 4, 5, generator=gen), torch.tensor([2, 0, 4])


# --------------------------------------------------------------------------- grouped_gemm validation
@pytest.mark.parametrize(
    ("mutate", "argument"),
    [
        (lambda x, w, g: (x[0], w, g), "x_MK"),
        (lambda x, w, g: (x, w[0], g), "w_EKN"),
        (lambda x, w, g: (x, w, g[None]), "group_sizes_E"),
        (lambda x, w, g: (x[:, :3].contiguous(), w, g), "x_MK"),  # K mismatch
        (lambda x, w, g: (x, w, g[:2]), "group_sizes_E"),  # wrong E
        (lambda x, w, g: (x, w.double(), g), "w_EKN.dtype"),
        (lambda x, w, g: (x.long(), w.long(), g), "x_MK"),
        (lambda x, w, g: (x, w, g.float()), "group_sizes_E"),
        (lambda x, w, g: (x, w, torch.tensor([2, 1, 4])), "group_sizes_E"),  # sums to 7, M is 6
        (lambda x, w, g: (x, w, torch.tensor([7, -1, 0])), "group_sizes_E"),  # negative
        (lambda x, w, g: (torch.randn(4, 6).T, w, g), "x_MK"),  # non-contiguous
        (lambda x, w, g: (x, torch.randn(3, 8, 5)[:, ::2], g), "w_EKN"),  # strided view
        (lambda x, w, g: (x, w[:0], g[:0]), "w_EKN"),  # no experts
        (lambda x, w, g: (x.numpy(), w, g), "x_MK"),
    ],
)
def test_grouped_gemm_rejects_bad_input(mutate, argument):
    with pytest.raises(ValueError, match=argument.replace(".", r"\.")):
        kernels.grouped_gemm(*mutate(*_gg_inputs()))


def test_grouped_gemm_rejects_unknown_backend_and_lists_the_known_ones():
    with pytest.raises(ValueError, match="backend.*torch.*triton"):
        kernels.grouped_gemm(*_gg_inputs(), backend="cublas")


def test_grouped_gemm_rejects_float64_on_triton():
    x, w, g = _gg_inputs()
    with pytest.raises(ValueError, match="x_MK.dtype"):
        kernels.grouped_gemm(x.double(), w.double(), g, backend="triton")
    assert kernels.grouped_gemm(x.double(), w.double(), g, backend="torch").dtype == torch.float64


# --------------------------------------------------------------------------- routing validation
@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda: kernels.topk_routing(torch.randn(3, 4, 5), 2), "logits_TE"),
        (lambda: kernels.topk_routing(torch.randn(3, 4), 5), "top_k"),
        (lambda: kernels.topk_routing(torch.randn(3, 4), 0), "top_k"),
        (lambda: kernels.topk_routing(torch.randn(3, 4), 2, scoring="relu"), "scoring"),
        (lambda: kernels.topk_routing(torch.randn(3, 4), 2, bias_E=torch.zeros(3)), "bias_E"),
        (lambda: kernels.topk_routing(torch.randn(4, 3).T, 2), "logits_TE"),
        (lambda: kernels.topk_routing(torch.randint(0, 3, (3, 4)), 2), "logits_TE"),
        (lambda: kernels.sort_by_expert(torch.tensor([[0, 4]]), 4), "experts_TK"),
        (lambda: kernels.sort_by_expert(torch.tensor([[-1, 2]]), 4), "experts_TK"),
        (lambda: kernels.sort_by_expert(torch.tensor([0.0, 1.0]), 4), "experts_TK"),
        (lambda: kernels.sort_by_expert(torch.tensor([[0, 1]]), 0), "num_experts"),
        (lambda: kernels.permute(torch.randn(2, 3), torch.tensor([0, 4]), 2), "sorted_slots_M"),
        (
            lambda: kernels.permute(torch.randn(2, 3), torch.tensor([0, 1], dtype=torch.int32), 2),
            "sorted_slots_M",
        ),
        (lambda: kernels.permute(torch.randn(2, 3), torch.arange(5), 2), "sorted_slots_M"),
        (lambda: kernels.permute(torch.randn(2, 3), torch.arange(4), 0), "top_k"),
        (lambda: kernels.permute(torch.randn(3, 2).T, torch.arange(4), 2), "x_TD"),
        (lambda: kernels.unpermute(torch.randn(4, 3), torch.arange(4), torch.rand(2)), "weights_TK"),
        (lambda: kernels.unpermute(torch.randn(3, 3), torch.arange(4), torch.rand(2, 2)), "sorted_slots_M"),
        (lambda: kernels.unpermute(torch.randn(4), torch.arange(4), torch.rand(2, 2)), "y_MD"),
    ],
)
def test_routing_ops_reject_bad_input(call, argument):
    with pytest.raises(ValueError, match=argument):
        call()


# --------------------------------------------------------------------------- backend selection
def test_automatic_backend_is_torch_on_cpu():
    assert kernels.GROUPED_GEMM_BACKENDS.select(None, torch.device("cpu")) == "torch"
    assert kernels.ROUTING_BACKENDS.select(None, torch.device("cpu")) == "torch"


def test_environment_variable_overrides_the_argument(monkeypatch):
    calls = []
    torch_impl = kernels.GROUPED_GEMM_BACKENDS.get("torch")
    spy = kernels.GroupedGemmBackend(
        forward=lambda *args: calls.append("fwd") or torch_impl.forward(*args),
        weight_grad=torch_impl.weight_grad,
        dtypes=torch_impl.dtypes,
    )
    kernels.GROUPED_GEMM_BACKENDS.register("spy", spy)
    try:
        monkeypatch.setenv(GG_ENV, "spy")
        y = kernels.grouped_gemm(*_gg_inputs(), backend="triton")  # the environment wins
        assert calls == ["fwd"]
        monkeypatch.setenv(GG_ENV, "torch")
        assert torch.equal(y, kernels.grouped_gemm(*_gg_inputs(), backend="spy"))
        assert calls == ["fwd"]
    finally:
        kernels.GROUPED_GEMM_BACKENDS.unregister("spy")


def test_environment_variable_selects_triton_under_the_interpreter(monkeypatch):
    monkeypatch.setenv(ROUTING_ENV, "triton")
    monkeypatch.setenv(GG_ENV, "triton")
    assert kernels.ROUTING_BACKENDS.select("torch", torch.device("cpu")) == "triton"
    assert kernels.GROUPED_GEMM_BACKENDS.select(None, torch.device("cpu")) == "triton"
    x, w, g = _gg_inputs()
    torch.testing.assert_close(kernels.grouped_gemm(x, w, g), kernels.grouped_gemm(x, w, g), rtol=0, atol=0)


def test_bad_environment_variable_names_itself(monkeypatch):
    monkeypatch.setenv(ROUTING_ENV, "cuda")
    with pytest.raises(ValueError, match=ROUTING_ENV):
        kernels.topk_routing(torch.randn(3, 4), 2)


def test_triton_backend_needs_cuda_or_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="triton.*CUDA"):
        kernels.grouped_gemm(*_gg_inputs(), backend="triton")


def test_registry_rejects_bad_names():
    with pytest.raises(ValueError, match="identifier"):
        kernels.ROUTING_BACKENDS.register("not a name", kernels.ROUTING_BACKENDS.get("torch"))


# --------------------------------------------------------------------------- custom ops
def _op_samples(backend="torch"):
    x, w, g = _gg_inputs()
    logits = torch.randn(5, 4)
    slots = torch.tensor([0, 3, 5, 1, 2, 4, 7, 6, 9, 8])
    return [
        (torch.ops.specdec_kernels.grouped_gemm, (x.requires_grad_(), w.requires_grad_(), g, False, backend)),
        (torch.ops.specdec_kernels.grouped_gemm_wgrad, (x.detach(), torch.randn(6, 5), g, backend)),
        (
            torch.ops.specdec_kernels.topk_routing,
            (logits.requires_grad_(), None, 2, "softmax", True, backend),
        ),
        (torch.ops.specdec_kernels.sort_by_expert, (torch.randint(0, 4, (5, 2)), 4, backend)),
        (torch.ops.specdec_kernels.permute, (torch.randn(5, 3, requires_grad=True), slots, 2, backend)),
        (
            torch.ops.specdec_kernels.unpermute,
            (
                torch.randn(10, 3, requires_grad=True),
                slots,
                torch.rand(5, 2, requires_grad=True),
                5,
                2,
                "torch",
            ),
        ),
    ]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("index", range(6))
def test_custom_ops_pass_opcheck(index, backend):
    """Schema, fake (meta) implementation and autograd registration agree with the real op."""
    op, args = _op_samples(backend)[index]
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_eager_direct_path_equals_the_custom_op(backend):
    """Without autograd the public functions skip the dispatcher; results must not change."""
    x_TD = torch.randn(6, 5, generator=torch.Generator().manual_seed(1))
    logits_TE = torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
    w_EDD = torch.randn(4, 5, 5, generator=torch.Generator().manual_seed(3))

    def pipeline(*leaves):
        weights_TK, experts_TK = kernels.topk_routing(leaves[1], 2, backend=backend)
        slots_M, sizes_E, _ = kernels.sort_by_expert(experts_TK, 4, backend=backend)
        y_MD = kernels.grouped_gemm(
            kernels.permute(leaves[0], slots_M, 2, backend=backend), leaves[2], sizes_E, backend=backend
        )
        return kernels.unpermute(y_MD, slots_M, weights_TK, backend=backend)

    with torch.no_grad():
        direct = pipeline(x_TD, logits_TE, w_EDD)
    through_ops = pipeline(*(t.clone().requires_grad_() for t in (x_TD, logits_TE, w_EDD)))
    torch.testing.assert_close(direct, through_ops.detach(), rtol=0, atol=0)


def test_torch_compile_traces_the_whole_pipeline_without_graph_breaks():
    num_experts, top_k = 4, 2

    def moe(x_TD, router_DE, w_EDD):
        weights_TK, experts_TK = kernels.topk_routing(x_TD @ router_DE, top_k, renormalize=True)
        slots_M, sizes_E, _ = kernels.sort_by_expert(experts_TK, num_experts)
        y_MD = kernels.grouped_gemm(kernels.permute(x_TD, slots_M, top_k), w_EDD, sizes_E)
        return kernels.unpermute(y_MD, slots_M, weights_TK)

    args = (torch.randn(7, 8), torch.randn(8, num_experts), torch.randn(num_experts, 8, 8))
    compiled = torch.compile(moe, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(*args), moe(*args))


# --------------------------------------------------------------------------- import rules
@pytest.mark.slow
def test_kernels_imports_and_runs_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, kernels\n"
        "assert not kernels.triton_available()\n"
        "x, w, g = torch.randn(4, 3), torch.randn(2, 3, 5), torch.tensor([1, 3])\n"
        "assert kernels.grouped_gemm(x, w, g).shape == (4, 5)\n"
        "try:\n"
        "    kernels.grouped_gemm(x, w, g, backend='triton')\n"
        "except ValueError as err:\n"
        "    assert 'not installed' in str(err)\n"
        "else:\n"
        "    raise AssertionError('expected ValueError')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in (GG_ENV, ROUTING_ENV)}
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True, timeout=120)


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_triton_is_imported_only_inside_kernels():
    offenders = [
        str(path.relative_to(REPO))
        for top in ("specdec", "moe", "experiments", "paper")
        for path in (REPO / top).rglob("*.py")
        if "triton" in _imports(path)
    ]
    assert offenders == []


def test_kernels_imports_no_other_project_package():
    offenders = [
        str(path.relative_to(REPO))
        for path in (REPO / "kernels").rglob("*.py")
        if _imports(path) & {"specdec", "moe", "experiments", "paper"}
    ]
    assert offenders == []
