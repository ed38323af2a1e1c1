"""Quality of a target's weights, measured as llama.cpp measures it: per-token log-probabilities
(:mod:`~specdec.quality.logprobs`), perplexity and KL divergence with ``llama-perplexity``'s
protocol (:mod:`~specdec.quality.perplexity`), llama.cpp's own tool run beside it
(:mod:`~specdec.quality.llama_perplexity`) and its tokens held against ours
(:mod:`~specdec.quality.tokens`), and the held-out text (:mod:`~specdec.quality.text`).
``specdec perplexity`` (:mod:`~specdec.quality.command`) drives them."""

from specdec.quality.logprobs import log_softmax, sequence_logits, token_logprobs
from specdec.quality.perplexity import chunk_tokens, measure, ppl_with_stderr

__all__ = ["log_softmax", "sequence_logits", "token_logprobs", "chunk_tokens", "measure", "ppl_with_stderr"]
