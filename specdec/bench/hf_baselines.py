"""``transformers``' own ``generate`` as benchmark methods: ``hf/plain``, ``hf/prompt_lookup``
(``prompt_lookup_num_tokens=γ``) and ``hf/assistant`` (``assistant_model``, a draft model)."""

from __future__ import annotations

import time
from typing import Any

from specdec.bench.interleave import MethodFn, Prompt
from specdec.bench.report import PromptResult
from specdec.seeds import check_seed

__all__ = ["HF_BASELINES", "hf_method"]

HF_BASELINES = ("plain", "prompt_lookup", "assistant")


def _generate_kwargs(model: Any, mode: str, temperature: float, gamma: int, assistant: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"do_sample": temperature > 0}
    if temperature > 0:
        # transformers would otherwise add its default top_k=50; ours samples the full distribution.
        kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
    if mode == "prompt_lookup":
        kwargs["prompt_lookup_num_tokens"] = gamma
    elif mode == "assistant":
        assistant.generation_config.num_assistant_tokens = gamma
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        kwargs["assistant_model"] = assistant
    pad = model.generation_config.pad_token_id
    if pad is None:
        eos = model.generation_config.eos_token_id
        pad = eos[0] if isinstance(eos, list) else eos
    kwargs["pad_token_id"] = pad
    return kwargs


def hf_method(model: Any, mode: str, temperature: float, gamma: int, assistant: Any = None) -> MethodFn:
    """A benchmark method running ``model.generate`` in ``mode`` (one of :data:`HF_BASELINES`)."""
    import torch

    if mode not in HF_BASELINES:
        raise ValueError(f"unknown transformers baseline {mode!r}; known: {', '.join(HF_BASELINES)}")
    kwargs = _generate_kwargs(model, mode, temperature, gamma, assistant)

    def run(prompt: Prompt, seed: int, max_new_tokens: int) -> PromptResult:
        x = torch.tensor([prompt.ids], device=model.device)
        torch.manual_seed(check_seed(seed))
        sync = torch.cuda.synchronize if x.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, **kwargs)
        sync()
        return PromptResult(
            prompt.set, prompt.index, y[0, len(prompt.ids) :].tolist(), time.perf_counter() - t0
        )

    return run
