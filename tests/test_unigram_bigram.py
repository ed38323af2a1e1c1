"""The count-based ``unigram`` and ``bigram`` drafters: counts, smoothing, caching, proposals, exactness."""

from __future__ import annotations

import math

import pytest
import torch
from _tiny import TableTarget, byte_tokenizer

import specdec
from specdec.drafters import ngram_lm
from specdec.drafters.ngram_lm import BigramDrafter, UnigramDrafter, count_ngrams, load_counts
from specdec.protocols import DecodeState, DraftCall
from specdec.registry import DRAFTERS, create_drafter
from specdec.sampling import SamplingParams, logits_to_probs
from specdec.testing import assert_same_distribution
from specdec.verify.noise import PositionNoise

TOY_DOCS = ["abab abc", "ba", "zzz"]
V = 259  # byte tokenizer: 256 bytes + 3 specials


@pytest.fixture
def toy_corpus(monkeypatch, tmp_path):
    """A tiny known corpus as the only source, and a private cache dir."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(ngram_lm.CORPUS_SOURCES, "toy", lambda: list(TOY_DOCS))
    return byte_tokenizer()


def _target(tokenizer) -> TableTarget:
    target = TableTarget(_table())
    target.tokenizer = tokenizer
    return target


def _table() -> torch.Tensor:
    # A trigram logits table over the byte vocabulary is V^3 floats (69 MB): use a bigram table
    # broadcast over the first index instead.
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, V, V, generator=g) * 2.0).expand(V, V, V)


def _state(last_tokens: list[int], sampling: SamplingParams) -> DecodeState:
    B = len(last_tokens)
    tokens_BL = torch.zeros((B, 8), dtype=torch.long)
    tokens_BL[:, 0] = torch.tensor(last_tokens)
    ones = torch.ones(B, dtype=torch.long)
    return DecodeState(tokens_BL, ones, ones.clone(), torch.zeros(B, dtype=torch.bool), sampling)


def _propose(drafter, last_tokens: list[int], sampling: SamplingParams, depth: int, seed: int = 0):
    """The drafter's proposal for one row per last token (each at its own slot, added first), as
    tokens ``[B, K]`` and probabilities ``[B, K, V]`` (None when every row is greedy)."""
    B = len(last_tokens)
    for slot in range(B):
        if not drafter.active[slot]:
            drafter.add(slot, [last_tokens[slot]], None)
    call = DraftCall(
        list(range(B)), [depth] * B, _state(last_tokens, sampling), [sampling] * B,
        PositionNoise([seed + b for b in range(B)]),
    )  # fmt: skip
    p = drafter.propose(call)
    assert p.counts_B == [depth] * B
    probs = None if p.probs_TV is None else p.probs_TV.view(B, depth, p.probs_TV.shape[-1])
    return p.tokens_T.view(B, depth), probs


def test_count_ngrams_counts_within_documents_only():
    counts = count_ngrams([[1, 2, 1, 2], [2, 1], [], [5, 99, 5]], vocab_size=6)
    assert counts.unigram_V.tolist() == [0, 3, 3, 0, 0, 2]  # 99 is outside the vocabulary: dropped
    # bigrams: (1,2) x2, (2,1) x2 (one inside each of the first two documents); none across documents
    # and none through the dropped token (5, 99, 5 gives no (5, 5)).
    assert counts.indptr_V1.tolist() == [0, 0, 1, 2, 2, 2, 2]
    assert counts.next_N.tolist() == [2, 1] and counts.count_N.tolist() == [2, 2]
    assert counts.context_counts_V().tolist() == [0, 2, 2, 0, 0, 0]
    with pytest.raises(ValueError, match="vocab_size"):
        count_ngrams([[1]], vocab_size=0)


def test_counts_are_cached_as_safetensors(toy_corpus, tmp_path):
    calls = []

    class Counting:
        def __init__(self, tok):
            self.tok = tok

        def get_vocab(self):
            return self.tok.get_vocab()

        def __call__(self, docs, **kw):
            calls.append(len(docs))
            return self.tok(docs, **kw)

    tok = Counting(toy_corpus)
    first = load_counts(tok, V, sources=["toy"])
    files = list((tmp_path / "cache" / "ngram_lm").glob("*.safetensors"))
    assert len(files) == 1 and files[0].name.startswith("toy-")
    again = load_counts(tok, V, sources="toy")  # comma-string form of the same sources
    assert calls == [3]  # the second load read the cache, it did not tokenize
    for name in ("unigram_V", "indptr_V1", "next_N", "count_N"):
        assert torch.equal(getattr(first, name), getattr(again, name))
    assert first.num_tokens == sum(len(d) for d in TOY_DOCS)
    load_counts(tok, V, sources=["toy"], cache=False)
    assert calls == [3, 3]
    with pytest.raises(ValueError, match="corpus sources"):
        load_counts(tok, V, sources=["nope"])
    with pytest.raises(ValueError, match="max_chars"):
        load_counts(tok, V, sources=["toy"], max_chars=0)


def test_unigram_is_add_k_smoothed_counts(toy_corpus):
    k = 0.5
    drafter = UnigramDrafter(_target(toy_corpus), k=k, sources=["toy"])
    ids = toy_corpus("".join(TOY_DOCS), add_special_tokens=False).input_ids
    c = torch.bincount(torch.tensor(ids), minlength=V).double()
    expected = (c + k) / (len(ids) + k * V)
    probs = drafter.draft_probs_V(SamplingParams(temperature=1.0))
    torch.testing.assert_close(probs.double(), expected, rtol=1e-5, atol=1e-7)
    # Processed exactly like a target: temperature, top-k through logits_to_probs.
    warm = drafter.draft_probs_V(SamplingParams(temperature=0.5, top_k=3))
    torch.testing.assert_close(warm, logits_to_probs(expected.log().float(), 0.5, 3, None))
    assert int((warm > 0).sum()) == 3


def test_bigram_backs_off_to_the_unigram(toy_corpus):
    k, uk = 0.01, 1.0
    drafter = BigramDrafter(_target(toy_corpus), k=k, unigram_k=uk, sources=["toy"])
    docs_ids = toy_corpus(TOY_DOCS, add_special_tokens=False).input_ids
    flat = torch.tensor([t for d in docs_ids for t in d])
    unigram = (torch.bincount(flat, minlength=V).double() + uk) / (len(flat) + uk * V)
    a, b, z, q = (toy_corpus(ch, add_special_tokens=False).input_ids[0] for ch in "abzq")
    pair = torch.zeros(V, V, dtype=torch.float64)
    for d in docs_ids:
        for x, y in zip(d, d[1:], strict=False):
            pair[x, y] += 1
    prev = torch.tensor([a, z, q])  # seen context, self-loop context, unseen context
    log_q = drafter.log_draft_BV(prev)
    for row, x in enumerate(prev.tolist()):
        expected = (pair[x] + k * V * unigram) / (pair[x].sum() + k * V)
        torch.testing.assert_close(torch.softmax(log_q[row].double(), -1), expected, rtol=1e-4, atol=1e-7)
    # after "a" the corpus has only "b": it dominates; an unseen context is exactly the unigram.
    assert int(log_q[0].argmax()) == b
    torch.testing.assert_close(torch.softmax(log_q[2].double(), -1), unigram, rtol=1e-4, atol=1e-7)


def test_proposals_greedy_and_sampled(toy_corpus):
    target = _target(toy_corpus)
    a, b = (toy_corpus(ch, add_special_tokens=False).input_ids[0] for ch in "ab")
    bigram = BigramDrafter(target, num_slots=2, sources=["toy"], k=0.001)
    tokens, probs = _propose(bigram, [a, b], SamplingParams(temperature=0.0), 3)
    assert tokens.shape == (2, 3) and probs is None  # greedy: point masses
    assert tokens[0, 0] == b and tokens[1, 0] == a  # "ab" and "ba" in the corpus
    unigram = UnigramDrafter(target, sources=["toy"])
    _, probs = _propose(unigram, [a], SamplingParams(temperature=1.0), 4)
    torch.testing.assert_close(probs.sum(-1), torch.ones(1, 4))
    assert _propose(unigram, [a], SamplingParams(), 0)[0].shape == (1, 0)


def test_bigram_chains_each_draft_on_the_previous_one(toy_corpus):
    """Draft k's probabilities are the processed bigram law of draft k-1 (and of the last committed
    token for k = 0), and every draft token lies in the support it was drawn from."""
    drafter = BigramDrafter(_target(toy_corpus), num_slots=6, sources=["toy"], k=0.05)
    a = toy_corpus("a", add_special_tokens=False).input_ids[0]
    sampling = SamplingParams(temperature=0.8, top_p=0.9)
    tokens, probs = _propose(drafter, [a] * 6, sampling, 4, seed=2)
    prev_B = torch.full((6,), a)
    for k in range(4):
        expected = logits_to_probs(drafter.log_draft_BV(prev_B), 0.8, None, 0.9)
        torch.testing.assert_close(probs[:, k], expected)
        prev_B = tokens[:, k]
    assert bool((probs.gather(-1, tokens.unsqueeze(-1)) > 0).all())


@pytest.mark.statistical
def test_unigram_draws_follow_its_probabilities(toy_corpus):
    """Draft tokens are distributed as the probabilities the proposal returns (G-test, false alarm 1e-6)."""
    drafter = UnigramDrafter(_target(toy_corpus), num_slots=4000, sources=["toy"], k=2.0)
    sampling = SamplingParams(temperature=1.0, top_k=6)
    tokens, probs = _propose(drafter, [0] * 4000, sampling, 5, seed=1)
    counts = torch.bincount(tokens.flatten(), minlength=V)
    expected = probs[0, 0].double()
    support = (expected > 0).nonzero().flatten().tolist()
    assert len(support) == 6
    assert_same_distribution(
        {t: int(counts[t]) for t in range(V) if counts[t] or expected[t] > 0},
        {t: float(expected[t]) for t in range(V) if counts[t] or expected[t] > 0},
        alpha=1e-6,
    )


def test_greedy_output_equals_plain_decoding(toy_corpus):
    target = _target(toy_corpus)
    prompt = [toy_corpus("abab", add_special_tokens=False).input_ids]
    plain = specdec.generate(target, prompt, drafter="none", temperature=0.0, max_new_tokens=20)
    for name in ("unigram", "bigram"):
        drafter = create_drafter(name, target, sources=["toy"])
        out = specdec.generate(target, prompt, drafter=drafter, temperature=0.0, max_new_tokens=20, gamma=3)
        assert out.token_ids == plain.token_ids
        assert out.metrics.num_proposed > 0


def test_registry_and_validation(toy_corpus):
    assert {"unigram", "bigram"} <= set(DRAFTERS.names())
    target = _target(toy_corpus)
    with pytest.raises(ValueError, match="k \\(add-k"):
        UnigramDrafter(target, k=0.0, sources=["toy"])
    with pytest.raises(ValueError, match="k \\(add-k"):
        BigramDrafter(target, unigram_k=-1, sources=["toy"])
    bare = TableTarget(_table())
    with pytest.raises(ValueError, match="tokenizer"):
        BigramDrafter(bare, sources=["toy"])
    assert math.isclose(
        float(BigramDrafter(bare, tokenizer=toy_corpus, sources=["toy"]).base_V.sum()),
        0.005 * V,
        rel_tol=1e-4,
    )
