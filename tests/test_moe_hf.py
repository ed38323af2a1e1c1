"""transformers interop: MoE.from_hf equals Mixtral / Qwen2-MoE / Qwen3-MoE blocks, and swap_moe_blocks
leaves whole-model logits unchanged (tiny random-init models, fp32, <= 1e-5).

Legend: B batch, S sequence, D hidden size, V vocab.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

import moe

TINY = {
    "vocab_size": 96,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "num_experts_per_tok": 2,
}


def mixtral_config(**extra):
    return MixtralConfig(**TINY, intermediate_size=40, num_local_experts=4, **extra)


def qwen2_config(**extra):
    return Qwen2MoeConfig(
        **TINY,
        intermediate_size=48,
        moe_intermediate_size=20,
        shared_expert_intermediate_size=36,
        num_experts=6,
        **extra,
    )


def qwen3_config(**extra):
    return Qwen3MoeConfig(**TINY, intermediate_size=48, moe_intermediate_size=20, num_experts=6, **extra)


BLOCKS = [
    pytest.param(MixtralSparseMoeBlock, mixtral_config, {}, id="mixtral"),
    pytest.param(Qwen2MoeSparseMoeBlock, qwen2_config, {"norm_topk_prob": False}, id="qwen2-moe"),
    pytest.param(Qwen2MoeSparseMoeBlock, qwen2_config, {"norm_topk_prob": True}, id="qwen2-moe-norm"),
    pytest.param(Qwen3MoeSparseMoeBlock, qwen3_config, {"norm_topk_prob": False}, id="qwen3-moe"),
    pytest.param(Qwen3MoeSparseMoeBlock, qwen3_config, {"norm_topk_prob": True}, id="qwen3-moe-norm"),
]


@pytest.mark.parametrize(("block_cls", "make_config", "extra"), BLOCKS)
@pytest.mark.parametrize("experts_implementation", ["eager", "grouped_mm"])
def test_from_hf_matches_the_block(block_cls, make_config, extra, experts_implementation):
    torch.manual_seed(0)
    config = make_config(**extra)
    config._experts_implementation = experts_implementation
    block = block_cls(config).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(std=0.2)
    layer = moe.MoE.from_hf(block)
    assert not layer.training
    assert layer.config.router.renormalize == extra.get("norm_topk_prob", True)
    assert (layer.shared_experts is not None) == (block_cls is Qwen2MoeSparseMoeBlock)
    x = torch.randn(3, 5, config.hidden_size)
    with torch.no_grad():
        expected = block(x)
        got = layer(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_from_hf_rejects_other_modules_and_activations():
    with pytest.raises(ValueError, match="unsupported MoE block Linear"):
        moe.MoE.from_hf(torch.nn.Linear(4, 4))
    block = MixtralSparseMoeBlock(mixtral_config(hidden_act="gelu"))
    with pytest.raises(ValueError, match="SiLU"):
        moe.from_hf(block)


MODELS = [
    pytest.param(MixtralForCausalLM, mixtral_config, id="mixtral"),
    pytest.param(Qwen2MoeForCausalLM, lambda: qwen2_config(norm_topk_prob=False), id="qwen2-moe"),
    pytest.param(Qwen3MoeForCausalLM, lambda: qwen3_config(norm_topk_prob=True), id="qwen3-moe"),
]


@pytest.mark.parametrize(("model_cls", "make_config"), MODELS)
def test_swap_moe_blocks_keeps_model_logits(model_cls, make_config):
    torch.manual_seed(0)
    model = model_cls(make_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(std=0.5)  # decisive routing: no top-k choice sits on a rounding-level tie
    input_ids = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        before = model(input_ids).logits
    swapped = moe.swap_moe_blocks(model)
    assert swapped is model
    layers = moe.moe_layers(model)
    assert len(layers) == 2 and all(isinstance(layer.mlp, moe.MoE) for layer in model.model.layers)
    with torch.no_grad():
        after = model(input_ids).logits
    assert after.shape == (2, 9, 96)
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)
    assert sum(layer.stats()["total_slots"] for layer in layers) == 2 * 2 * 9 * 2


def test_swap_moe_blocks_needs_a_moe_model():
    with pytest.raises(ValueError, match="model: found no MoE block"):
        moe.swap_moe_blocks(torch.nn.Sequential(torch.nn.Linear(4, 4)))


@pytest.mark.parametrize(("block_cls", "make_config", "extra"), [BLOCKS[0], BLOCKS[1]])
def test_from_hf_bfloat16_stays_close(block_cls, make_config, extra):
    """In bf16 our combine accumulates in fp32 (transformers' in bf16), so we agree to bf16 rounding."""
    torch.manual_seed(0)
    block = block_cls(make_config(**extra)).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(std=0.2)
    block = block.to(torch.bfloat16)
    layer = moe.MoE.from_hf(block)
    assert layer.experts.w_gate_up.dtype == torch.bfloat16
    x = torch.randn(2, 6, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        expected, got = block(x), layer(x)
    assert got.dtype == torch.bfloat16
    expected, got = expected.float(), got.float()
    torch.testing.assert_close(got, expected, atol=3e-2 * expected.abs().max().item(), rtol=0)
