"""The ``unigram`` and ``bigram`` drafters: count-based draft models estimated from offline text.

Legend: B batch, K draft length (γ), V vocabulary, N distinct bigrams, D documents.

Leviathan et al. 2023 (arXiv 2211.17192, §4.2 and Table 3) measure α for "trivial" approximation
models, a unigram and a bigram language model, beside small transformers: unigram < bigram < small
transformer, at temperature 0 and 1. These drafters are those baselines for our targets. Their
statistics are counted once from text that is on every machine, tokenized with the target's own
tokenizer: the HumanEval prompts, the MT-Bench questions, Python standard-library source and the
Python documentation topics shipped with the interpreter (``pydoc_data``; a quarter of them held
out as the quality text, :mod:`specdec.quality.text`). Counts are cached as
safetensors under the specdec cache dir (``$SPECDEC_CACHE/ngram_lm``), keyed by tokenizer and
corpus, so later constructions take well under a second.

Smoothing is add-k: an order-n model adds k pseudo-counts per vocabulary entry, spread like the
order-(n−1) model (uniform below the unigram)::

    draft_probs(y)     ∝ c(y) + k                       unigram (plain add-k)
    draft_probs(y | x) ∝ c(x, y) + k · V · unigram(y)   bigram  (add-k with a unigram base)

so an unseen context falls back to the unigram instead of a uniform guess. Both are
:class:`~specdec.protocols.SlotDrafter` objects with no state per row: a row's draft token is drawn
from ``sampling_probs(log draft_probs, the row's settings)`` (temperature, top-k, top-p, as the target)
with the row's keyed noise (stream ``"draft"``, by output position), and those probabilities are
returned, so verification stays exact.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdec.drafters.slot_table import StatelessSlots, draw_draft, ragged_proposal
from specdec.protocols import DraftCall, SlotProposal, Target
from specdec.sampling import SamplingParams, sampling_probs

__all__ = [
    "CORPUS_SOURCES",
    "DEFAULT_SOURCES",
    "NGramCounts",
    "corpus_documents",
    "count_ngrams",
    "load_counts",
    "UnigramDrafter",
    "BigramDrafter",
]

_FORMAT_VERSION = "1"
DEFAULT_MAX_CHARS = 1_500_000
"""Characters read per corpus source (the standard library alone holds several MB)."""


# --- the offline corpus -----------------------------------------------------------------------------


def _humaneval_documents() -> list[str]:
    from specdec.prompt_sets import humaneval_prompts

    return humaneval_prompts()


def _mtbench_documents() -> list[str]:
    from specdec.prompt_sets import mtbench_questions

    return [turn for q in mtbench_questions() for turn in q["turns"]]


def _stdlib_documents() -> list[str]:
    """Top-level ``*.py`` files of the running interpreter's standard library, in name order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [p.read_text(encoding="utf-8", errors="replace") for p in sorted(root.glob("*.py"))]


def _pydoc_documents() -> list[str]:
    """The Python documentation topics (language reference text) shipped in ``pydoc_data``, less the
    ones held out as the quality text (:func:`specdec.quality.text.training_topics`)."""
    from pydoc_data.topics import topics

    from specdec.quality.text import training_topics

    return [topics[name] for name in training_topics()]


CORPUS_SOURCES: dict[str, Callable[[], list[str]]] = {
    "humaneval": _humaneval_documents,
    "mtbench": _mtbench_documents,
    "stdlib": _stdlib_documents,
    "pydoc": _pydoc_documents,
}
"""Source name -> function returning its documents (each counted separately: no bigram spans two)."""
DEFAULT_SOURCES = ("humaneval", "mtbench", "stdlib", "pydoc")


def _parse_sources(sources: Sequence[str] | str) -> tuple[str, ...]:
    if isinstance(sources, str):
        sources = [s.strip() for s in sources.split(",") if s.strip()]
    sources = tuple(sources)
    unknown = [s for s in sources if s not in CORPUS_SOURCES]
    if not sources or unknown:
        raise ValueError(
            f"sources must be a non-empty list of corpus sources from {sorted(CORPUS_SOURCES)}, "
            f"got {sources!r}"
        )
    return sources


def corpus_documents(
    sources: Sequence[str] = DEFAULT_SOURCES, *, max_chars: int = DEFAULT_MAX_CHARS
) -> list[str]:
    """The documents of each source, in order, up to ``max_chars`` characters per source."""
    docs: list[str] = []
    for name in _parse_sources(sources):
        used = 0
        for doc in CORPUS_SOURCES[name]():
            if used >= max_chars:
                break
            doc = doc[: max_chars - used]
            used += len(doc)
            docs.append(doc)
    return docs


# --- counting and caching ---------------------------------------------------------------------------


@dataclass(frozen=True)
class NGramCounts:
    """Unigram and bigram counts over a vocabulary of V tokens.

    ``unigram_V``: c(y). Bigrams in CSR form: the successors of token x are
    ``next_N[indptr_V1[x]:indptr_V1[x+1]]`` with counts ``count_N[...]`` (sorted by successor id).
    """

    unigram_V: torch.Tensor
    indptr_V1: torch.Tensor
    next_N: torch.Tensor
    count_N: torch.Tensor

    @property
    def vocab_size(self) -> int:
        return self.unigram_V.numel()

    @property
    def num_tokens(self) -> int:
        return int(self.unigram_V.sum())

    def context_counts_V(self) -> torch.Tensor:
        """c(x) = Σ_y c(x, y): how often each token was followed by another one."""
        return self.count_N.new_zeros(self.vocab_size).index_add_(
            0, torch.repeat_interleave(torch.arange(self.vocab_size), self.indptr_V1.diff()), self.count_N
        )


def count_ngrams(docs_ids: Sequence[Sequence[int]], vocab_size: int) -> NGramCounts:
    """Count unigrams and within-document bigrams of token-id documents (ids >= V are dropped)."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    lengths = [len(ids) for ids in docs_ids]
    flat_T = torch.tensor([t for ids in docs_ids for t in ids], dtype=torch.long)
    doc_T = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long))
    keep_T = (flat_T >= 0) & (flat_T < vocab_size)
    unigram_V = torch.bincount(flat_T[keep_T], minlength=vocab_size)
    # A bigram never spans two documents, nor a dropped token.
    pair_ok = (doc_T[:-1] == doc_T[1:]) & keep_T[:-1] & keep_T[1:]
    keys = (flat_T[:-1] * vocab_size + flat_T[1:])[pair_ok]
    keys, count_N = torch.unique(keys, sorted=True, return_counts=True)
    prev_N, next_N = keys // vocab_size, keys % vocab_size
    indptr_V1 = torch.zeros(vocab_size + 1, dtype=torch.long)
    indptr_V1[1:] = torch.bincount(prev_N, minlength=vocab_size).cumsum(0)
    return NGramCounts(unigram_V, indptr_V1, next_N, count_N.long())


def _tokenizer_fingerprint(tokenizer: Any) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps([type(tokenizer).__name__, vocab]).encode()).hexdigest()


def _cache_root() -> Path:
    from specdec.targets.loading import cache_dir

    return cache_dir() / "ngram_lm"


def load_counts(
    tokenizer: Any,
    vocab_size: int,
    *,
    sources: Sequence[str] | str = DEFAULT_SOURCES,
    max_chars: int = DEFAULT_MAX_CHARS,
    cache: bool = True,
) -> NGramCounts:
    """Counts of the offline corpus tokenized with ``tokenizer``, from the cache when present.

    The cache key hashes the tokenizer's vocabulary, ``vocab_size`` and the corpus text itself, so a
    different tokenizer, interpreter or package version never reads stale counts.
    """
    from safetensors.torch import load_file, save_file

    sources = _parse_sources(sources)
    if isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars < 1:
        raise ValueError(f"max_chars must be an int >= 1, got {max_chars!r}")
    docs = corpus_documents(sources, max_chars=max_chars)
    h = hashlib.sha256(f"{_FORMAT_VERSION}|{vocab_size}|{_tokenizer_fingerprint(tokenizer)}".encode())
    for doc in docs:
        h.update(doc.encode("utf-8", errors="replace"))
        h.update(b"\0")
    path = _cache_root() / f"{'-'.join(sources)}-{h.hexdigest()[:16]}.safetensors"
    if cache and path.is_file():
        t = load_file(str(path))
        return NGramCounts(t["unigram_V"], t["indptr_V1"], t["next_N"], t["count_N"])
    docs_ids = tokenizer(docs, add_special_tokens=False)["input_ids"] if docs else []
    counts = count_ngrams(docs_ids, vocab_size)
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        os.close(fd)
        tensors = {
            "unigram_V": counts.unigram_V,
            "indptr_V1": counts.indptr_V1,
            "next_N": counts.next_N,
            "count_N": counts.count_N,
        }
        save_file(tensors, tmp, metadata={"sources": ",".join(sources), "format": _FORMAT_VERSION})
        os.replace(tmp, path)  # atomic: a reader never sees half a file
    return counts


# --- the drafters -----------------------------------------------------------------------------------


def _check_k(k: Any) -> float:
    if isinstance(k, bool) or not isinstance(k, (int, float)) or not k > 0 or k == float("inf"):
        raise ValueError(f"k (add-k pseudo-count) must be a finite number > 0, got {k!r}")
    return float(k)


class _CountDrafter(StatelessSlots):
    """What the unigram and bigram drafters share: the token counts of a corpus tokenised with the
    target's tokenizer (or ``tokenizer``), no state per row, and the call: row i drafts its depth, each
    token from the draft law :meth:`log_draft` gives for the token before it, processed with the row's
    settings and drawn with its keyed noise (greedy rows: the argmax, a point mass)."""

    def log_draft(self, prev: int) -> torch.Tensor:
        """The draft law's logits ``[V]`` after token ``prev``."""
        raise NotImplementedError

    def propose(self, call: DraftCall) -> SlotProposal:
        self.check_propose(call)
        state, noise = call.state, call.noise
        last = state.last_tokens_B().tolist()
        outputs = (state.lengths_B - state.prompt_lengths_B).tolist()  # output position of draft 1
        drafted: list[list[int]] = [[] for _ in call.depths]
        probs: list[list[torch.Tensor | None]] = [[] for _ in call.depths]
        for i, (K, params) in enumerate(zip(call.depths, call.sampling, strict=True)):
            prev = last[i]
            for k in range(K):
                prev, p = draw_draft(self.log_draft(prev), params, noise, i, outputs[i] + k)
                drafted[i].append(prev)
                probs[i].append(p)
        return ragged_proposal(drafted, probs, call.sampling, self.vocab_size)

    def _load_counts(
        self,
        target: Target,
        name: str,
        k: float,
        sources: Sequence[str] | str,
        max_chars: int,
        tokenizer: Any,
        cache: bool,
    ) -> NGramCounts:
        self.k = _check_k(k)
        self.vocab_size = V = int(target.vocab_size)
        tokenizer = tokenizer if tokenizer is not None else getattr(target, "tokenizer", None)
        if tokenizer is None:
            raise ValueError(
                f"drafter {name!r} counts text tokenized with the target's tokenizer: the target has no "
                "`tokenizer` attribute, so pass one with tokenizer=..."
            )
        counts = load_counts(tokenizer, V, sources=sources, max_chars=max_chars, cache=cache)
        self.num_tokens = counts.num_tokens
        return counts


class UnigramDrafter(_CountDrafter):
    """A :class:`~specdec.protocols.SlotDrafter` that draws every draft token from one unigram law.

    Options: ``k`` (add-k pseudo-count, default 0.1), ``sources`` (corpus sources, see
    :data:`CORPUS_SOURCES`), ``max_chars`` (per source), ``tokenizer`` (default ``target.tokenizer``),
    ``cache`` (reuse cached counts).
    """

    def __init__(
        self,
        target: Target,
        *,
        num_slots: int = 1,
        k: float = 0.1,
        sources: Sequence[str] | str = DEFAULT_SOURCES,
        max_chars: int = DEFAULT_MAX_CHARS,
        tokenizer: Any = None,
        cache: bool = True,
    ) -> None:
        super().__init__(num_slots)
        counts = self._load_counts(target, "unigram", k, sources, max_chars, tokenizer, cache)
        self.log_draft_V = (counts.unigram_V.double() + self.k).log().float()
        self.log_draft_V -= torch.logsumexp(self.log_draft_V, 0)
        self._probs: tuple[SamplingParams, torch.Tensor] | None = None

    def draft_probs_V(self, sampling: SamplingParams) -> torch.Tensor:
        """The processed unigram law (computed once per sampling setting)."""
        if self._probs is None or self._probs[0] != sampling:
            probs_V = sampling_probs(self.log_draft_V, sampling)
            self._probs = (sampling, probs_V)
        return self._probs[1]

    def log_draft(self, prev: int) -> torch.Tensor:
        """The unigram law's log-probabilities (the context is ignored)."""
        return self.log_draft_V


class BigramDrafter(_CountDrafter):
    """A :class:`~specdec.protocols.SlotDrafter` that drafts each token from the bigram law of the
    previous one.

    Options: ``k`` (add-k pseudo-count spread like the unigram, default 0.005, i.e. ~250 pseudo-counts
    over SmolLM2's 49,152 tokens), ``unigram_k`` (add-k of the unigram base, default 1), ``sources``,
    ``max_chars``, ``tokenizer``, ``cache`` as for :class:`UnigramDrafter`. The default k's maximise
    held-out log-likelihood (a 10% document split of the default corpus, SmolLM2 tokenizer).
    """

    def __init__(
        self,
        target: Target,
        *,
        num_slots: int = 1,
        k: float = 0.005,
        unigram_k: float = 1.0,
        sources: Sequence[str] | str = DEFAULT_SOURCES,
        max_chars: int = DEFAULT_MAX_CHARS,
        tokenizer: Any = None,
        cache: bool = True,
    ) -> None:
        super().__init__(num_slots)
        unigram_k = _check_k(unigram_k)
        counts = self._load_counts(target, "bigram", k, sources, max_chars, tokenizer, cache)
        V = self.vocab_size
        unigram_V = (counts.unigram_V.double() + unigram_k) / (counts.num_tokens + unigram_k * V)
        self.base_V = (self.k * V * unigram_V).float()  # pseudo-counts of every context
        self.indptr_V1, self.next_N = counts.indptr_V1, counts.next_N
        self.count_N = counts.count_N.float()

    def log_draft_BV(self, prev_B: torch.Tensor) -> torch.Tensor:
        """log draft_probs(· | x) for each row's previous token x (unnormalised: softmax-ready)."""
        B = prev_B.numel()
        weights_BV = self.base_V.repeat(B, 1)
        starts_B, ends_B = self.indptr_V1[prev_B], self.indptr_V1[prev_B + 1]
        lens_B = ends_B - starts_B
        if int(lens_B.sum()) > 0:
            rows = torch.repeat_interleave(torch.arange(B), lens_B)
            # Offsets of each row's CSR segment, flattened: start_b + 0 .. len_b - 1.
            offsets = torch.arange(int(lens_B.sum())) - torch.repeat_interleave(
                lens_B.cumsum(0) - lens_B, lens_B
            )
            idx = torch.repeat_interleave(starts_B, lens_B) + offsets
            weights_BV.index_put_((rows, self.next_N[idx]), self.count_N[idx], accumulate=True)
        return weights_BV.log()

    def log_draft(self, prev: int) -> torch.Tensor:
        """The bigram law's logits after ``prev``."""
        return self.log_draft_BV(torch.tensor([prev]))[0]
