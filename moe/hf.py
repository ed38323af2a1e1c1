"""transformers interop: build moe.MoE from a transformers sparse-MoE block, and swap it into a model.

Legend: D hidden size, H expert intermediate size, Hs shared-expert intermediate size, E experts.

Supported blocks (transformers >= 5, whose experts keep stacked weights gate_up_proj [E, 2H, D] and
down_proj [E, D, H], nn.Linear layout, gate rows first):

    MixtralSparseMoeBlock   softmax top-k, always renormalised (arXiv:2401.04088)
    Qwen2MoeSparseMoeBlock  softmax top-k, renormalised iff norm_topk_prob; one shared expert scaled by
                            sigmoid(shared_expert_gate(x))
    Qwen3MoeSparseMoeBlock  softmax top-k, renormalised iff norm_topk_prob

Converters register in HF_CONVERTERS by class name, so transformers is never imported here. The layer copies
the weights (in the block's dtype and device); its output equals the block's in eval mode (Mixtral's
training-time input jitter is not reproduced). After swap_moe_blocks, transformers' `output_router_logits`
records nothing for the swapped layers: use the layers' own last_aux_loss / collect_aux_losses instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import MoEConfig
from .layer import MoE
from .routers import SoftmaxTopKRouter


def _check_silu(act: Callable, where: str) -> None:
    probe = torch.linspace(-4, 4, 17)
    if not torch.allclose(act(probe), F.silu(probe)):
        raise ValueError(f"{where}: only SiLU (SwiGLU) experts are supported, got activation {act!r}")


def _routed(block: nn.Module, *, renormalize: bool, **shared) -> MoE:
    """Layer with the block's router and stacked experts copied in; `shared` adds shared-expert options."""
    experts, gate = block.experts, block.gate
    _check_silu(experts.act_fn, type(block).__name__)
    weight = experts.gate_up_proj
    config = MoEConfig(
        dim=experts.hidden_dim,
        hidden_dim=experts.intermediate_dim,
        num_experts=experts.num_experts,
        top_k=gate.top_k,
        router=SoftmaxTopKRouter.Config(renormalize=renormalize),
        **shared,
    )
    layer = MoE(config=config, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        layer.router.weight.copy_(gate.weight)
        layer.experts.w_gate_up.copy_(experts.gate_up_proj.transpose(1, 2))  # [E, D, 2H], gate columns first
        layer.experts.w_down.copy_(experts.down_proj.transpose(1, 2))  # [E, H, D]
    return layer


def _from_mixtral(block: nn.Module) -> MoE:
    return _routed(block, renormalize=True)


def _from_qwen3_moe(block: nn.Module) -> MoE:
    return _routed(block, renormalize=bool(block.gate.norm_topk_prob))


def _from_qwen2_moe(block: nn.Module) -> MoE:
    mlp = block.shared_expert
    _check_silu(mlp.act_fn, "Qwen2MoeSparseMoeBlock.shared_expert")
    layer = _routed(
        block,
        renormalize=bool(block.gate.norm_topk_prob),
        num_shared_experts=1,
        shared_hidden_dim=mlp.intermediate_size,
        shared_expert_gate=True,
    )
    with torch.no_grad():
        shared = layer.shared_experts
        shared.w_gate_up.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], dim=0).T)  # [D, 2Hs]
        shared.w_down.copy_(mlp.down_proj.weight.T)  # [Hs, D]
        shared.output_gate.copy_(block.shared_expert_gate.weight)  # [1, D]
    return layer


HF_CONVERTERS: dict[str, Callable[[nn.Module], MoE]] = {
    "MixtralSparseMoeBlock": _from_mixtral,
    "Qwen2MoeSparseMoeBlock": _from_qwen2_moe,
    "Qwen3MoeSparseMoeBlock": _from_qwen3_moe,
}


def from_hf(block: nn.Module) -> MoE:
    """moe.MoE equivalent to a transformers sparse-MoE block (weights copied, layer in the block's mode)."""
    name = type(block).__name__
    convert = HF_CONVERTERS.get(name)
    if convert is None:
        raise ValueError(
            f"block: unsupported MoE block {name}; supported: {', '.join(sorted(HF_CONVERTERS))}"
        )
    layer = convert(block)
    layer.train(block.training)
    return layer


def swap_moe_blocks(model: nn.Module) -> nn.Module:
    """Replace, in place, every supported transformers MoE block inside model by its moe.MoE; returns model.

    Raises ValueError when the model holds no supported block.
    """
    targets = [
        (parent, child_name, child)
        for parent in model.modules()
        for child_name, child in parent.named_children()
        if type(child).__name__ in HF_CONVERTERS
    ]
    if not targets:
        raise ValueError(f"model: found no MoE block to swap (looked for {', '.join(sorted(HF_CONVERTERS))})")
    for parent, child_name, child in targets:
        setattr(parent, child_name, from_hf(child))
    return model
