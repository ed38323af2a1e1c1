"""The ``qself`` drafter: the target's own weights quantised to int4 draft for it.

A target that runs with float weights (``fp32`` or ``bf16``) streams 4-8x the bytes of an int4
copy of itself, and the copy predicts the target's tokens far more often than a separate small model
would. In the spirit of ML-SpecQD (arXiv 2503.13565) and QSpec (arXiv 2410.11305), :func:`qself`
builds that copy from the target's own packed weights (each product dequantised to float32 and
quantised group-wise to int4, :func:`kernels.quant.quantize_int4`; the embedding and norms are
shared) and drafts with it as the ``model`` drafter does (its own KV cache, sampled from its own
processed distribution, that distribution returned): verification by rejection sampling keeps the
output exactly the target's.

In the engine ``qself`` is one :class:`~specdec.drafters.model.ModelDrafter` over the copy, a cache
row per engine slot.
"""

from __future__ import annotations

from typing import Any

from specdec.drafters.model import ModelDrafter

__all__ = ["qself", "quantized_copy"]


def qself(target: Any, *, num_slots: int = 1, weights: str = "int4", min_prob: float = 0.0) -> ModelDrafter:
    """A :class:`~specdec.drafters.model.ModelDrafter` over ``num_slots`` engine rows whose model is
    ``target`` requantised to ``weights`` (``int4`` or ``int8``); the target must be a native Llama
    target with float weights."""
    return ModelDrafter(target, num_slots=num_slots, model=quantized_copy(target, weights), min_prob=min_prob)


def _check_float_target(target: Any) -> None:
    from specdec.targets.llama import LlamaTarget

    if not isinstance(target, LlamaTarget):
        raise ValueError(
            f"qself drafts with a quantised copy of a native Llama target, got {type(target).__name__}"
        )
    if target.weights not in ("fp32", "bf16"):
        raise ValueError(
            "qself is for a target with float weights (fp32 or bf16); this one runs "
            f"weights={target.weights!r}, already quantised (load it with weights='fp32')"
        )


def quantized_copy(target: Any, weights: str = "int4") -> Any:
    """The native Llama ``target`` (float weights) with its products requantised to ``weights``
    (``int4`` or ``int8``), sharing its embedding, norms, tokenizer and device."""
    from specdec.targets.llama import LlamaTarget
    from specdec.targets.llama_weights import requantized

    _check_float_target(target)
    return LlamaTarget(
        target.config,
        requantized(target.packed_weights, weights, backend=target.linear_backend),
        weights=weights,
        dtype=target.dtype,
        device=target.device,
        linear_backend=target.linear_backend,
        tokenizer=target.tokenizer,
        eos_token_ids=target.eos_token_ids,
    )
