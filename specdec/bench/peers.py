"""The CPU peers users compare us with, as benchmark methods: llama.cpp on the same GGUF file.

- ``llama.cpp/plain`` and ``llama.cpp/prompt_lookup``: llama-cpp-python (``pip install -e ".[peers]"``,
  which builds llama.cpp from source) generating from the same prompt ids with the same threads,
  plain and with its prompt-lookup drafter (``LlamaPromptLookupDecoding``). Greedy is llama.cpp's
  argmax; sampled runs use its sampler with top-k, top-p, min-p and the repeat penalty switched off.
  The KV cache is reset before every prompt, and generation stops at an end-of-sequence token or
  ``max_new_tokens``, as ours does.
- ``llama-bench`` (:mod:`~specdec.bench.llama_bench`), when the binary is at ``$LLAMA_BENCH`` or on
  ``PATH``: its ``tg128`` and ``pp1, pp4, pp7, pp16`` figures (tokens per second) in a table beside
  our methods' tok/s and verify blocks, with the ratios (they are not run on our prompts).

Without llama-cpp-python, or for a target that does not come as a GGUF file, the peer is skipped
with a note.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from specdec.bench.interleave import MethodFn, Prompt
from specdec.bench.report import PromptResult

__all__ = ["PEERS", "llama_cpp_methods"]

PEERS = ("llama.cpp",)
PROMPT_LOOKUP_TOKENS = 10
"""``num_pred_tokens`` of llama-cpp-python's prompt lookup (its default)."""


def llama_cpp_methods(
    gguf: Path, *, threads: int, temperature: float, eos_token_ids: tuple[int, ...], n_ctx: int = 4096
) -> dict[str, MethodFn]:
    """``llama.cpp/plain`` and ``llama.cpp/prompt_lookup`` on ``gguf``; ``ImportError`` without
    llama-cpp-python."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    def method(draft: Any) -> MethodFn:
        llm = Llama(
            model_path=str(gguf),
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=n_ctx,
            verbose=False,
            draft_model=draft,
        )

        def run(prompt: Prompt, seed: int, max_new_tokens: int) -> PromptResult:
            llm.reset()
            llm.set_seed(seed)
            out: list[int] = []
            t0 = time.perf_counter()
            for token in llm.generate(
                prompt.ids, temp=temperature, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True
            ):
                out.append(int(token))
                if token in eos_token_ids or len(out) >= max_new_tokens:
                    break
            return PromptResult(prompt.set, prompt.index, out, time.perf_counter() - t0)

        return run

    return {
        "llama.cpp/plain": method(None),
        "llama.cpp/prompt_lookup": method(LlamaPromptLookupDecoding(num_pred_tokens=PROMPT_LOOKUP_TOKENS)),
    }
