"""transformers' fp32 greedy output of SmolLM2-135M: the reference of every greedy-equality test."""

from __future__ import annotations

import torch

SMOLLM2_TEXTS = (
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village by the sea,",
    "<|im_start|>user\nExplain in detail how a hash table works.<|im_end|>\n<|im_start|>assistant\n",
)
"""The prompts the greedy-equality tests share (no EOS within SMOLLM2_NEW_TOKENS tokens)."""
SMOLLM2_NEW_TOKENS = 32


class GreedyReference:
    """transformers' greedy continuation of SmolLM2-135M (fp32, dequantised from the shipped GGUF, as
    ``load_hf_model`` loads it), computed once per prompt for the whole test run: greedy decoding is
    deterministic, so a shorter or EOS-stopped continuation is a prefix of the longest one computed.
    pytest-xdist workers share the computed continuations through ``store`` (a JSON file under a
    file lock), so each prompt is generated once per run; the model loads only when one is missing."""

    def __init__(self, store) -> None:
        from specdec.targets.loading import load_tokenizer

        self.store = store
        self.tokenizer = load_tokenizer("smollm2-135m")
        self.eos = 2
        self._model = None

    @property
    def model(self):
        """The transformers model (loaded on first use)."""
        if self._model is None:
            from specdec.targets.loading import load_hf_model

            self._model = load_hf_model("smollm2-135m")
        return self._model

    def __call__(self, ids: list[int], max_new_tokens: int, *, stop_at_eos: bool = True) -> list[int]:
        import json

        from filelock import FileLock

        key = " ".join(map(str, ids))
        with FileLock(str(self.store) + ".lock"):
            known = json.loads(self.store.read_text()) if self.store.is_file() else {}
            out = known.get(key, [])
            if len(out) < max_new_tokens and self.eos not in out:
                x = torch.tensor([ids])
                with torch.inference_mode():
                    y = self.model.generate(
                        x,
                        attention_mask=torch.ones_like(x),
                        max_new_tokens=max_new_tokens,
                        do_sample=False,
                        pad_token_id=self.eos,
                        eos_token_id=None,
                    )
                out = known[key] = y[0, len(ids) :].tolist()
                self.store.write_text(json.dumps(known))
        out = out[:max_new_tokens]
        if stop_at_eos and self.eos in out:
            out = out[: out.index(self.eos) + 1]
        return out

    def prompts(self) -> list[list[int]]:
        """:data:`SMOLLM2_TEXTS` as token ids."""
        return [self.tokenizer(t).input_ids for t in SMOLLM2_TEXTS]
