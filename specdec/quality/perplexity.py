"""Perplexity and KL divergence with llama.cpp's ``llama-perplexity`` protocol.

Legend: C chunk length (``ctx``), N scored positions of a chunk (C - C/2 - 1), V vocabulary.

The protocol (``tools/perplexity/perplexity.cpp``: ``perplexity()`` and ``kl_divergence()``):

- the text is tokenised once, with the tokenizer's special tokens (a BOS where the vocabulary adds
  one); it needs at least ``2 * ctx`` tokens;
- it is cut into ``len // ctx`` chunks of ``ctx`` tokens (at most ``chunks``); the rest is unused;
- each chunk is one forward from an empty cache; where the vocabulary adds a BOS, the chunk's first
  token is *replaced* by BOS (``bos="auto"``; ``"replace"`` / ``"keep"`` force one or the other);
- only the second half is scored: the logits at positions ``C/2 .. C-2`` predict tokens
  ``C/2+1 .. C-1`` (N = C - C/2 - 1 tokens a chunk), so every scored token has C/2 tokens of context;
- PPL = exp(mean NLL) over all scored tokens, ± ``PPL * sqrt((E[NLL²] - E[NLL]²) / (count - 1))``;
- against reference weights, per scored token: KL(reference ‖ weights) over the whole vocabulary,
  and whether both argmaxes agree; reported as the mean KL (± its standard error), its 99th
  percentile (linear interpolation at ``0.99 * (count - 1)``) and the top-1 agreement ("Same top p").

llama.cpp stores the reference's log-probabilities as 16-bit integers over a 16-nat range and drops
reference tokens below log p = -16 from the KL sum; here both distributions are float32
(:func:`specdec.quality.logprobs.log_softmax`) and the KL sum is exact, in float64.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.percentile import percentile
from specdec.protocols import Target
from specdec.quality.logprobs import log_softmax, sequence_logits

__all__ = [
    "BOS_MODES",
    "Scores",
    "RunningStats",
    "chunk_tokens",
    "score_chunk",
    "kl_divergence",
    "ppl_with_stderr",
    "tokenizer_adds_bos",
    "tokenize_text",
    "measure",
    "evaluate_text",
    "evaluate_tokens",
]

BOS_MODES = ("auto", "replace", "keep")
"""``auto``: replace each chunk's first token by BOS iff the tokenizer adds a BOS (llama.cpp);
``replace``: always (needs a BOS token); ``keep``: never."""


def tokenizer_adds_bos(tokenizer: Any) -> bool:
    """Whether ``tokenizer(text)`` starts with its BOS token (llama.cpp's ``llama_vocab_get_add_bos``)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    with_special = tokenizer("a")["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    return len(with_special) > len(plain) and with_special[0] == bos


def tokenize_text(tokenizer: Any, text: str) -> list[int]:
    """``text`` as llama.cpp tokenises it for ``llama-perplexity``: special tokens added (a BOS where
    the tokenizer adds one), special-token text in ``text`` read as plain text."""
    try:
        return list(tokenizer(text, split_special_tokens=True)["input_ids"])
    except TypeError:  # a tokenizer without the option
        return list(tokenizer(text)["input_ids"])


def chunk_tokens(
    ids: Sequence[int] | torch.Tensor, *, ctx: int, chunks: int | None = None, bos_token_id: int | None = None
) -> torch.Tensor:
    """``[n_chunks, ctx]``: the text's consecutive chunks (``len(ids) // ctx``, at most ``chunks``),
    each chunk's first token replaced by ``bos_token_id`` when given. ``ValueError`` for a ``ctx``
    below 4 or odd, ``chunks`` below 1, or fewer than ``2 * ctx`` tokens."""
    if not isinstance(ctx, int) or ctx < 4 or ctx % 2:
        raise ValueError(f"ctx must be an even integer >= 4 (half of each chunk is scored), got {ctx!r}")
    if chunks is not None and (not isinstance(chunks, int) or chunks < 1):
        raise ValueError(f"chunks must be an integer >= 1 or None (all), got {chunks!r}")
    ids_L = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
    if ids_L.numel() < 2 * ctx:
        raise ValueError(
            f"the text tokenizes to only {ids_L.numel()} tokens; a context of {ctx} needs at least "
            f"{2 * ctx} (llama-perplexity's minimum)"
        )
    n = ids_L.numel() // ctx if chunks is None else min(chunks, ids_L.numel() // ctx)
    chunks_NC = ids_L[: n * ctx].reshape(n, ctx).clone()
    if bos_token_id is not None:
        chunks_NC[:, 0] = bos_token_id
    return chunks_NC


@dataclass
class Scores:
    """One chunk under one set of weights: ``nll_N`` (float64) of the scored tokens, the full
    ``logprobs_NV`` (float32) and the argmax ``top1_N``."""

    nll_N: torch.Tensor
    logprobs_NV: torch.Tensor
    top1_N: torch.Tensor


def score_chunk(target: Target, chunk_C: torch.Tensor) -> Scores:
    """Run one chunk from an empty cache and score its second half (the logits at ``C/2 .. C-2``)."""
    C = chunk_C.numel()
    first = C // 2
    logits_NV = sequence_logits(target, chunk_C, positions=torch.arange(first, C - 1))
    logprobs_NV = log_softmax(logits_NV).cpu()
    next_N = chunk_C[first + 1 :].cpu()
    nll_N = -logprobs_NV.gather(-1, next_N[:, None])[:, 0].double()
    return Scores(nll_N=nll_N, logprobs_NV=logprobs_NV, top1_N=logits_NV.argmax(dim=-1).cpu())


def kl_divergence(ref_logprobs_NV: torch.Tensor, logprobs_NV: torch.Tensor) -> torch.Tensor:
    """``[N]`` float64: KL(reference ‖ weights) = Σ_v p_ref(v) (log p_ref(v) - log p(v)) per row."""
    ref = ref_logprobs_NV.double()
    return (ref.exp() * (ref - logprobs_NV.double())).sum(dim=-1)


def ppl_with_stderr(sum_nll: float, sum_nll2: float, count: int) -> tuple[float, float | None]:
    """llama.cpp's final estimate: ``exp(mean)`` ± ``exp(mean) * sqrt(var / (count - 1))`` with
    ``var = E[NLL²] - E[NLL]²`` (None where the variance is not positive or count < 2)."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    mean = sum_nll / count
    ppl = math.exp(mean)
    var = sum_nll2 / count - mean * mean
    if var <= 0 or count < 2:
        return ppl, None
    return ppl, ppl * math.sqrt(var / (count - 1))


@dataclass
class RunningStats:
    """The sums one set of weights collects over chunks (llama.cpp's ``kl_divergence_result``)."""

    sum_nll: float = 0.0
    sum_nll2: float = 0.0
    count: int = 0
    kld: list[torch.Tensor] = field(default_factory=list)
    same_top: int = 0

    def add(self, scores: Scores, reference: Scores | None = None) -> None:
        """Add one chunk's scores (and, given the reference's scores of the same chunk, its KL)."""
        self.sum_nll += float(scores.nll_N.sum())
        self.sum_nll2 += float((scores.nll_N**2).sum())
        self.count += scores.nll_N.numel()
        if reference is not None:
            self.kld.append(kl_divergence(reference.logprobs_NV, scores.logprobs_NV))
            self.same_top += int((scores.top1_N == reference.top1_N).sum())

    def ppl(self) -> float:
        """The running PPL (progress lines)."""
        return math.exp(self.sum_nll / self.count)

    def result(self) -> dict[str, float | int | None]:
        """``ppl``, ``ppl_stderr``, ``nll_mean``, ``n_tokens`` and the KL fields (``kld_mean``,
        ``kld_mean_stderr``, ``kld_p99``, ``kld_max``, ``top1_agree``, ``top1_agree_stderr``: None
        without a reference)."""
        ppl, stderr = ppl_with_stderr(self.sum_nll, self.sum_nll2, self.count)
        out: dict[str, float | int | None] = {
            "ppl": ppl,
            "ppl_stderr": stderr,
            "nll_mean": self.sum_nll / self.count,
            "n_tokens": self.count,
        }
        keys = ("kld_mean", "kld_mean_stderr", "kld_p99", "kld_max", "top1_agree", "top1_agree_stderr")
        out |= dict.fromkeys(keys)
        if self.kld:
            kld = torch.cat(self.kld)
            n = kld.numel()
            mean = float(kld.mean())
            var = float((kld**2).mean()) - mean * mean  # llama.cpp's mean_and_uncertainty
            ordered = kld.sort().values.tolist()
            agree = self.same_top / n
            out |= {
                "kld_mean": mean,
                "kld_mean_stderr": math.sqrt(var / (n - 1)) if var > 0 and n > 10 else 0.0,
                "kld_p99": percentile(ordered, 99),
                "kld_max": ordered[-1],
                "top1_agree": agree,
                "top1_agree_stderr": math.sqrt(agree * (1 - agree) / (n - 1)) if n > 1 else None,
            }
        return out


def measure(
    targets: Mapping[str, Target],
    chunks_NC: torch.Tensor,
    *,
    reference: str | None = None,
    progress: Callable[[int, int, Mapping[str, RunningStats], float], None] | None = None,
    observe: Callable[[int, str, Scores], None] | None = None,
) -> dict[str, dict[str, float | int | None]]:
    """PPL (and, against ``reference``, the KL statistics) of each target over ``chunks_NC``.

    Chunk by chunk, every target in turn (so a slower machine moment touches all of them alike and
    only one chunk's log-probabilities are held); ``progress(done, total, stats, elapsed_s)`` after
    each chunk, ``observe(chunk, name, scores)`` after each target's chunk (a peer comparison). The
    reference's own KL fields are None."""
    if not targets:
        raise ValueError("targets must name at least one set of weights")
    if reference is not None and reference not in targets:
        raise ValueError(f"reference must be one of {list(targets)}, got {reference!r}")
    stats = {name: RunningStats() for name in targets}
    order = ([reference] if reference else []) + [n for n in targets if n != reference]
    t0 = time.perf_counter()
    for i, chunk_C in enumerate(chunks_NC):
        ref_scores = None
        for name in order:
            scores = score_chunk(targets[name], chunk_C)
            if observe is not None:
                observe(i, name, scores)
            if name == reference:
                ref_scores = scores
                stats[name].add(scores)
            else:
                stats[name].add(scores, ref_scores)
        if progress is not None:
            progress(i + 1, len(chunks_NC), stats, time.perf_counter() - t0)
    return {name: stats[name].result() for name in targets}


def evaluate_text(
    targets: Mapping[str, Target], text: str, *, tokenizer: Any, **options: Any
) -> dict[str, Any]:
    """Tokenise ``text`` (:func:`tokenize_text`) and :func:`evaluate_tokens` every target on it
    (``options``: ``ctx``, ``chunks``, ``bos``, ``reference``, ``progress``, ``observe``,
    ``chunks_hook``)."""
    return evaluate_tokens(targets, tokenize_text(tokenizer, text), tokenizer=tokenizer, **options)


def evaluate_tokens(
    targets: Mapping[str, Target],
    ids: Sequence[int],
    *,
    tokenizer: Any,
    ctx: int,
    chunks: int | None = None,
    bos: str = "auto",
    reference: str | None = None,
    progress: Callable[[int, int, Mapping[str, RunningStats], float], None] | None = None,
    observe: Callable[[int, str, Scores], None] | None = None,
    chunks_hook: Callable[[torch.Tensor], None] | None = None,
) -> dict[str, Any]:
    """Cut a text's tokens ``ids`` (ours, or a peer's tokens of the same text) into chunks
    (:func:`chunk_tokens`, the first token per ``bos``: :data:`BOS_MODES`, ``tokenizer``'s BOS) and
    :func:`measure` every target. Returns ``ctx``, ``n_chunks``, ``bos`` (``"replaced"`` or
    ``"kept"``), ``tokens_scored``, ``reference``, ``text_tokens`` and ``weights`` (name →
    statistics). ``chunks_hook(chunks_NC)`` sees the chunks before any target runs."""
    if bos not in BOS_MODES:
        raise ValueError(f"bos must be one of {BOS_MODES}, got {bos!r}")
    bos_id = getattr(tokenizer, "bos_token_id", None)
    replace = bos == "replace" or (bos == "auto" and tokenizer_adds_bos(tokenizer))
    if replace and bos_id is None:
        raise ValueError("bos='replace' needs a tokenizer with a BOS token")
    chunks_NC = chunk_tokens(ids, ctx=ctx, chunks=chunks, bos_token_id=bos_id if replace else None)
    for name, target in targets.items():
        limit = getattr(target, "max_context_length", None)
        if limit and ctx > limit:
            raise ValueError(f"ctx {ctx} is beyond the context of {name} ({limit} tokens)")
    if chunks_hook is not None:
        chunks_hook(chunks_NC)
    weights = measure(targets, chunks_NC, reference=reference, progress=progress, observe=observe)
    return {
        "ctx": ctx,
        "n_chunks": len(chunks_NC),
        "bos": "replaced" if replace else "kept",
        "tokens_scored": len(chunks_NC) * (ctx - ctx // 2 - 1),
        "reference": reference,
        "text_tokens": len(ids),
        "weights": weights,
    }
