"""The simple drafters: none, ngram (prompt lookup), model (an independent small LM)."""

from __future__ import annotations

import pytest
import torch
from _tiny import TableTarget, byte_tokenizer, random_table, save_tiny_checkpoint, tiny_llama

import specdec
from specdec.drafters.model import ModelDrafter, check_same_vocab
from specdec.drafters.ngram import NGramDrafter, lookup
from specdec.drafters.none import NoDrafter
from specdec.protocols import DecodeState, DraftCall, SlotDrafter, TargetOutput
from specdec.registry import DRAFTERS, create_drafter
from specdec.sampling import SamplingParams
from specdec.verify.noise import PositionNoise


def state_for(
    rows: list[list[int]], capacity: int = 64, sampling: SamplingParams | None = None
) -> DecodeState:
    tokens = torch.zeros((len(rows), capacity), dtype=torch.long)
    for b, r in enumerate(rows):
        tokens[b, : len(r)] = torch.tensor(r)
    lengths = torch.tensor([len(r) for r in rows])
    return DecodeState(
        tokens_BL=tokens,
        prompt_lengths_B=lengths.clone(),
        lengths_B=lengths,
        finished_B=torch.zeros(len(rows), dtype=torch.bool),
        sampling=sampling or SamplingParams(temperature=0.0),
    )


# --- registry -------------------------------------------------------------------------------------------


def test_builtin_drafters_are_registered_and_follow_the_protocol():
    target = TableTarget(random_table(5, seed=0))
    for name in ("none", "ngram", "default"):  # default: prompt lookup (no shipped head for this target)
        assert isinstance(create_drafter(name, target), SlotDrafter)
    assert (
        create_drafter("ngram", target).num_slots == 1
        and create_drafter("ngram", target, num_slots=3).num_slots == 3
    )
    assert DRAFTERS.resolve("default") in DRAFTERS.names()


# --- none -----------------------------------------------------------------------------------------------


def test_none_proposes_nothing():
    d = NoDrafter(TableTarget(random_table(5, seed=0)), num_slots=2)
    d.add(0, [1, 2], None)
    d.add(1, [3], None)
    hot = SamplingParams(temperature=0.9)
    p = d.propose(DraftCall([0, 1], [4, 2], state_for([[1, 2], [3]]), [hot, hot], PositionNoise([0, 1])))
    assert p.counts_B == [0, 0] and p.tokens_T.numel() == 0 and p.probs_TV is None
    with pytest.raises(ValueError, match="no options"):
        NoDrafter(None, gamma=3)


# --- ngram ----------------------------------------------------------------------------------------------


def t(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs)


def test_lookup_prefers_longest_ngram_and_latest_match():
    kw = dict(max_ngram=3, min_ngram=1)
    # last 3-gram (1, 2, 3) occurs at 0 and 5: latest is 5 → continuation [9, 9]
    hist = t([1, 2, 3, 4, 7, 1, 2, 3, 9, 9, 1, 2, 3])
    assert lookup(hist, 2, search="latest", **kw).tolist() == [9, 9]
    assert lookup(hist, 2, search="earliest", **kw).tolist() == [4, 7]
    # no 3-gram or 2-gram match, but the 1-gram (5) occurred: continuation after it
    hist = t([5, 8, 6, 1, 2, 3, 4, 0, 5])
    assert lookup(hist, 3, search="latest", **kw).tolist() == [8, 6, 1]
    # min_ngram=2 forbids the 1-gram fallback
    assert lookup(hist, 3, search="latest", max_ngram=3, min_ngram=2).tolist() == []


def test_lookup_clips_at_history_end_and_handles_short_histories():
    kw = dict(max_ngram=2, min_ngram=1, search="latest")
    assert lookup(t([4, 5, 4]), 5, **kw).tolist() == [5, 4]  # 1-gram 4 at 0 → [5, 4], clipped by history
    assert lookup(t([7]), 3, **kw).tolist() == []
    assert lookup(t([1, 2, 3]), 3, **kw).tolist() == []
    # the pattern's own occurrence does not count: (3,3) only at the end → 1-gram 3 at 1 → [3]
    assert lookup(t([2, 3, 3]), 4, **kw).tolist() == [3]


def test_ngram_lookups_skip_finished_rows():
    d = NGramDrafter(TableTarget(random_table(10, seed=0)))
    state = state_for([[1, 2, 3, 1, 2], [4, 5, 6], [7, 8, 7]])
    found = d.lookups(state, 3)
    assert [f.tolist() for f in found] == [[3, 1, 2], [], [8, 7]]  # a miss finds nothing
    state.finished_B[0] = True
    assert [f.tolist() for f in d.lookups(state, 3)] == [[], [], [8, 7]]
    assert [f.tolist() for f in d.lookups(state, 0)] == [[], [], []]


def test_ngram_slot_drafter_proposes_each_rows_own_lookup_ragged():
    """The engine's ``ngram``: one call, each row its own lookup up to its depth (no padding), point
    masses (one-hot where a row is sampled), a miss proposing nothing; then the engine over it."""
    from specdec.verify.noise import PositionNoise

    target = TableTarget(random_table(10, seed=0))
    d = NGramDrafter(target, num_slots=4)
    rows = [[1, 2, 3, 1, 2], [4, 5, 6], [7, 8, 7]]
    for slot, r in zip((3, 0, 1), rows, strict=True):
        d.add(slot, r, None)
    state = state_for(rows)
    hot = SamplingParams(temperature=0.7)
    p = d.propose(
        DraftCall([3, 0, 1], [2, 3, 3], state, [SamplingParams(), hot, hot], PositionNoise([1, 2, 3]))
    )
    assert p.counts_B == [2, 0, 2] and p.tokens_T.tolist() == [3, 1, 8, 7]
    assert p.probs_TV.shape == (4, 10) and p.probs_TV.sum().item() == 4 and p.probs_TV[2, 8] == 1
    assert p.chains([1], False).tokens_BK.shape == (1, 0)  # a sampled miss: an empty chain
    with pytest.raises(ValueError, match="hold no request"):
        d.propose(DraftCall([2], [1], state_for([rows[0]]), [hot]))
    kw = {"max_new_tokens": 12, "ignore_eos": True}
    plain = specdec.generate(target, rows, drafter="none", temperature=0.0, **kw).token_ids
    assert specdec.generate(target, rows, drafter="ngram", temperature=0.0, **kw).token_ids == plain


def test_ngram_options_are_validated():
    target = TableTarget(random_table(5, seed=0))
    with pytest.raises(ValueError, match="min_ngram"):
        NGramDrafter(target, max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError, match="max_ngram"):
        NGramDrafter(target, max_ngram=0)
    with pytest.raises(ValueError, match="search"):
        NGramDrafter(target, search="random")


def test_ngram_speeds_up_repetitive_text_on_a_copying_target():
    """A target that continues a cycle is predicted perfectly by prompt lookup: α = 1."""
    V = 6
    table = torch.full((V, V, V), -20.0)
    for a in range(V):
        for b in range(V):
            table[a, b, (b + 1) % V] = 20.0  # next = last + 1 (mod V)
    target = TableTarget(table)
    out = specdec.generate(
        target, [[0, 1, 2, 3, 4, 5, 0]], drafter="ngram", gamma=4, temperature=0.0, max_new_tokens=21
    )
    assert out.token_ids[0] == [(1 + i) % V for i in range(21)]
    assert out.metrics.acceptance_rate == 1.0
    assert out.metrics.mean_accepted_tokens == 5.0


# --- model ----------------------------------------------------------------------------------------------


def test_model_drafter_requires_a_model_and_a_shared_vocab():
    target = TableTarget(random_table(5, seed=0))
    with pytest.raises(ValueError, match="model=NAME_OR_PATH"):
        ModelDrafter(target)
    with pytest.raises(ValueError, match="vocab"):
        ModelDrafter(target, model=TableTarget(random_table(6, seed=0)))
    with pytest.raises(ValueError, match="model must be"):
        ModelDrafter(target, model=42)


def test_model_drafter_compares_tokenizers():
    from specdec.targets.hf import HFTarget

    tok = byte_tokenizer()
    target = HFTarget(tiny_llama(seed=0), tok)
    other = byte_tokenizer()
    other.add_tokens(["<extra>"])
    with pytest.raises(ValueError, match="tokenizer differs"):
        check_same_vocab(target, HFTarget(tiny_llama(seed=1, vocab_size=260), other))
    # Same tokenizer, logits padded to a wider matrix: accepted, logits cut to the target's width.
    d = ModelDrafter(target, num_slots=8, model=HFTarget(tiny_llama(seed=1, vocab_size=272), tok))
    ids = tok("abcabc").input_ids
    out = specdec.generate(
        target, [ids], drafter=d, temperature=1.0, seed=0, max_new_tokens=8, ignore_eos=True
    )
    assert len(out.token_ids[0]) == 8


def test_model_drafter_loads_a_checkpoint_by_path(tmp_path):
    from specdec.targets.hf import HFTarget

    tok = byte_tokenizer()
    target = HFTarget(tiny_llama(seed=0), tok)
    path = save_tiny_checkpoint(tmp_path / "draft", seed=0)
    d = create_drafter("model", target, model=str(path), backend="hf")
    ids = tok("hello").input_ids
    out = specdec.generate(
        target, [ids], drafter=d, temperature=0.0, max_new_tokens=10, gamma=3, ignore_eos=True
    )
    assert out.metrics.acceptance_rate == 1.0  # the same weights as the target


def test_model_drafter_proposes_sampled_tokens_with_their_probs():
    target = TableTarget(random_table(7, seed=0))
    d = ModelDrafter(target, num_slots=2, model=TableTarget(random_table(7, seed=1)), capacity=16)
    rows = [[1, 2, 3], [4]]
    for slot, r in enumerate(rows):
        d.add(slot, r, None)
    hot = SamplingParams(temperature=0.8, top_k=3)
    state = state_for(rows, sampling=hot)
    p = d.propose(DraftCall([0, 1], [4, 4], state, [hot, hot], PositionNoise([0, 1])))
    assert p.counts_B == [4, 4] and p.probs_TV.shape == (8, 7)
    assert torch.allclose(p.probs_TV.sum(-1), torch.ones(8))
    assert ((p.probs_TV > 0).sum(-1) <= 3).all()  # top-k applied with the row's sampling params
    chosen = p.probs_TV.gather(-1, p.tokens_T.unsqueeze(-1))
    assert (chosen > 0).all()
    # observe keeps each row's committed tokens but the last in its draft-cache row
    state.lengths_B = state.lengths_B + torch.tensor([2, 5])
    d.observe([0, 1], [1, 4], TargetOutput(logits_BTV=torch.zeros(2, 1, 7)), state=state)
    assert d.cached == [4, 4]  # row 0: its 5 committed tokens but the last; row 1: the 4 it has fed
