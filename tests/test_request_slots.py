"""Drafters as the engine's one slot drafter (:mod:`specdec.drafters.request_slots`,
:mod:`specdec.drafters.engine_drafter`).

A batched ``propose`` gives every row bitwise what it gets alone (tokens, counts, probabilities; mixed
depths, settings and lengths) for an instance per request (``RequestSlots``: Markov drafters, ``bigram``
by name), for one batched instance (``CohortSlots``: a Markov drafter, ``none``) and for the slot
drafter ``eagle-tree`` (a tiny head); a request's instance draws from the generator of
``mix_seed(seed, position, 1)``; it begins once, lazily, on the row as it was at the start of its first
step; slots come and go; ``make_slot_drafter`` resolves every kind of drafter and refuses bad arguments.

Legend: G rows of a call, K draft depth, L capacity, V vocabulary.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from _tiny import TableTarget, byte_tokenizer, random_table
from _tree_toys import TreeMarkovDrafter
from test_eagle_slots import tiny  # noqa: F401  (a fixture: a tiny Llama and an EAGLE head file)

from specdec.drafters import ngram_lm
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.engine_drafter import drafter_name, make_slot_drafter
from specdec.drafters.model import ModelDrafter
from specdec.drafters.ngram import NGramDrafter
from specdec.drafters.request_slots import CohortSlots, RequestSlots, mix_seed
from specdec.protocols import DecodeState, DraftCall, Proposal, SlotDrafter, SlotProposal, TargetOutput
from specdec.registry import DRAFTERS
from specdec.sampling import SamplingParams
from specdec.testing import MarkovModel
from specdec.verify.noise import PositionNoise
from specdec.verify.token_tree import TokenTree

pytestmark = pytest.mark.usefixtures("one_thread")

V = 6
TARGET = MarkovModel.random(V, order=2, seed=61)
DRAFT = MarkovModel.random(V, order=1, seed=62)
GREEDY = SamplingParams(temperature=0.0)
HOT = SamplingParams(temperature=0.8, top_k=4)
WARM = SamplingParams(temperature=1.0)
L = 32

# four rows at different lengths (prompt, tokens committed since), slots out of order, depths 0..3
PROMPTS = [[1, 2], [3], [4, 0, 2], [2, 2, 2, 1]]
EXTRA = [[5], [0, 1, 4], [3, 3], [1]]
SLOTS, DEPTHS = [3, 0, 2, 1], [3, 0, 2, 3]
SAMPLING = [GREEDY, HOT, HOT, WARM]
SEEDS = [11, 12, 2**64 - 5, 14]  # one seed past 2**63: int64 bits in PositionNoise


def rows(prompts: list[list[int]], extra: list[list[int]], sampling: SamplingParams = GREEDY) -> DecodeState:
    """The rows' states: prompt + the tokens committed since."""
    tokens = torch.zeros(len(prompts), L, dtype=torch.long)
    for i, (p, x) in enumerate(zip(prompts, extra, strict=True)):
        tokens[i, : len(p) + len(x)] = torch.tensor(p + x)
    P = torch.tensor([len(p) for p in prompts])
    n = torch.tensor([len(p) + len(x) for p, x in zip(prompts, extra, strict=True)])
    return DecodeState(tokens, P, n, torch.zeros(len(prompts), dtype=torch.bool), sampling)


def added(drafter: Any, slots: list[int], prompts: list[list[int]]) -> Any:
    for s, p in zip(slots, prompts, strict=True):
        drafter.add(s, p, TargetOutput(torch.zeros(1, len(p), V)))
    return drafter


def row_of(proposal: SlotProposal, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    start, n = sum(proposal.counts_B[:i]), proposal.counts_B[i]
    probs = None if proposal.probs_TV is None else proposal.probs_TV[start : start + n]
    return proposal.tokens_T[start : start + n], probs


def assert_rows_alone(
    make: Any, *, slots=SLOTS, prompts=PROMPTS, extra=EXTRA, depths=DEPTHS, vocab_size: int = V
) -> SlotProposal:
    """A batched propose of the rows equals each row proposed alone by a new drafter, bitwise; greedy
    rows' probabilities are zeros in the mixed call and None alone."""
    together = added(make(), slots, prompts)
    state = rows(prompts, extra)
    batched = together.propose(DraftCall(slots, depths, state, SAMPLING, PositionNoise(SEEDS)))
    assert isinstance(together, SlotDrafter) and batched.tree is None
    assert batched.probs_TV is not None and batched.probs_TV.shape == (sum(batched.counts_B), vocab_size)
    for i in range(len(slots)):
        alone = added(make(), [slots[i]], [prompts[i]])
        one = alone.propose(
            DraftCall(
                [slots[i]],
                [depths[i]],
                rows([prompts[i]], [extra[i]]),
                [SAMPLING[i]],
                PositionNoise([SEEDS[i]]),
            )
        )
        assert one.counts_B == [batched.counts_B[i]], i
        tokens, probs = row_of(batched, i)
        assert torch.equal(one.tokens_T, tokens), i
        if SAMPLING[i].greedy:
            assert one.probs_TV is None and (probs is None or not probs.any()), i
        else:
            assert torch.equal(one.probs_TV, probs), i
    return batched


# --- RequestSlots -----------------------------------------------------------------------------------
def test_mix_seed_is_the_engines_splitmix64_and_folds_signed_seeds():
    """Golden values of the engine's former ``decode.mix_seed``; a seed's int64 bits (as PositionNoise
    holds it) give the same generator seed as the unsigned seed."""
    assert mix_seed(0, 0, 1) == 10451216379200822465
    assert mix_seed(7, 3, 1) == 9889543983210544564
    assert mix_seed(2**64 - 5, 11, 1) == mix_seed(-5, 11, 1) == 16149365462724368202
    assert int(PositionNoise([2**64 - 5]).seeds_B[0]) == -5


def test_request_slots_batched_equals_each_row_alone_and_its_keyed_generator():
    """Markov drafters per request (slot 2's a point mass, so its sampled row is one-hot): the batched
    call equals each row alone, and each row equals its instance called directly with the generator
    of ``mix_seed(seed, output position, 1)``."""
    make = lambda: RequestSlots(  # noqa: E731
        lambda slot: DRAFT.as_drafter(point_mass=slot == 2), num_slots=4, vocab_size=V
    )
    batched = assert_rows_alone(make)
    assert batched.counts_B == DEPTHS
    state = rows(PROMPTS, EXTRA)
    for i, slot in enumerate(SLOTS):
        if DEPTHS[i] == 0:
            continue
        position = len(EXTRA[i])  # output position of the row's first draft
        generator = torch.Generator().manual_seed(mix_seed(SEEDS[i], position, 1))
        row = replace(state.row(i), sampling=SAMPLING[i])
        direct = DRAFT.as_drafter(point_mass=slot == 2).propose(row, DEPTHS[i], generator)
        tokens, probs = row_of(batched, i)
        assert torch.equal(direct.tokens_BK[0], tokens), i
        if slot == 2:
            assert direct.probs_BKV is None and torch.equal(
                probs, torch.nn.functional.one_hot(tokens, V).float()
            )
        elif not SAMPLING[i].greedy:
            assert torch.equal(direct.probs_BKV[0], probs), i
    # another seed draws other tokens for the sampled rows (the generator is really the row's)
    other = added(make(), SLOTS, PROMPTS).propose(
        DraftCall(SLOTS, DEPTHS, state, SAMPLING, PositionNoise([s + 1 for s in SEEDS[:2]] + [1, 2]))
    )
    assert not torch.equal(other.tokens_T, batched.tokens_T)


def test_request_slots_all_greedy_has_no_probs_and_no_noise_means_no_generator():
    calls = []

    class Spy:
        def begin(self, state, target_out): ...

        def propose(self, state, gamma, generator=None):
            calls.append(generator)
            return Proposal(torch.ones(1, gamma, dtype=torch.long), torch.full((1, gamma, V), 1 / V))

        def observe(self, state, num_accepted_B, target_out): ...

    d = added(RequestSlots(lambda slot: Spy(), num_slots=2, vocab_size=V), [0, 1], PROMPTS[:2])
    out = d.propose(DraftCall([0, 1], [2, 1], rows(PROMPTS[:2], EXTRA[:2]), [GREEDY, GREEDY]))
    assert out.probs_TV is None and out.counts_B == [2, 1] and calls == [None, None]


def test_bigram_by_name_rows_equal_alone(monkeypatch, tmp_path):
    """``bigram`` by name (a slot drafter built with its options) over a byte vocabulary: a batched call
    gives every row what it gets alone."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(ngram_lm.CORPUS_SOURCES, "toy", lambda: ["abab abc", "ba", "zzz"])
    target = TableTarget(torch.zeros(1, 1, 259).expand(259, 259, 259))  # the bigram never runs it
    target.tokenizer = byte_tokenizer()
    a, b = (ord(c) for c in "ab")
    prompts, extra = [[a, b, a], [b, b], [a, a, a, a], [a]], [[b], [a, b], [a], [b, b, b]]
    make = lambda: make_slot_drafter(target, "bigram", {"sources": ["toy"], "k": 0.05}, num_slots=4)  # noqa: E731
    d = make()
    assert isinstance(d, ngram_lm.BigramDrafter)
    batched = assert_rows_alone(make, prompts=prompts, extra=extra, vocab_size=259)
    assert batched.counts_B == DEPTHS


def test_request_slots_tree_for_one_row_chain_for_several():
    """A call of one row returns its instance's token tree (``tokens_T`` its main path); a call of
    several rows their chains, each equal to the row's tree's main path alone."""
    tree = TokenTree.from_branching([2, 2])
    make = lambda: RequestSlots(  # noqa: E731
        lambda slot: TreeMarkovDrafter(DRAFT, tree), num_slots=4, vocab_size=V
    )
    d = added(make(), [1], [PROMPTS[0]])
    one = d.propose(DraftCall([1], [2], rows(PROMPTS[:1], EXTRA[:1]), [HOT], PositionNoise([3])))
    assert isinstance(one.tree, Proposal) and one.tree.tree is not None
    assert one.counts_B == [2] and torch.equal(one.tokens_T, one.tree.tokens_BK[0])
    assert torch.equal(one.probs_TV, one.tree.probs_BKV[0])
    both = added(make(), [1, 0], PROMPTS[:2]).propose(
        DraftCall([1, 0], [2, 2], rows(PROMPTS[:2], EXTRA[:2]), [HOT, HOT], PositionNoise([3, 4]))
    )
    assert both.tree is None and both.counts_B == [2, 2]
    assert torch.equal(both.tokens_T[:2], one.tokens_T) and torch.equal(both.probs_TV[:2], one.probs_TV)


class Recorder:
    """A Drafter that records what it is told (row lengths) and counts catch-up as it goes."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.catch_up_s, self.catch_up_tokens = 0.0, 0

    def begin(self, state, target_out):
        self.calls.append(("begin", int(state.lengths_B[0]), int(state.prompt_lengths_B[0]), target_out))

    def propose(self, state, gamma, generator=None):
        self.calls.append(("propose", int(state.lengths_B[0]), gamma))
        n = int(state.lengths_B[0])
        self.catch_up_s += 0.5
        self.catch_up_tokens += n
        return Proposal(torch.full((1, gamma), n % V, dtype=torch.long))

    def observe(self, state, num_accepted_B, target_out):
        self.calls.append(
            ("observe", int(state.lengths_B[0]), num_accepted_B.tolist(), target_out.logits_BTV)
        )


def test_lazy_begin_once_at_the_first_propose_or_observe_on_the_steps_start():
    made: dict[int, Recorder] = {}
    d = RequestSlots(lambda slot: made.setdefault(slot, Recorder()), num_slots=3, vocab_size=V)
    out0, out2 = TargetOutput(torch.zeros(1, 3, V)), TargetOutput(torch.zeros(1, 2, V))
    d.add(0, [1, 2, 3], out0)
    d.add(2, [4, 5], out2)
    assert made[0].calls == [] and made[2].calls == []  # nothing until the slot's first step
    # step 1: slot 0 drafts (state: prompt + first token), slot 2 sits at depth 0 (not proposed)
    d.propose(DraftCall([0], [2], rows([[1, 2, 3]], [[4]]), [GREEDY], PositionNoise([0])))
    assert made[0].calls == [("begin", 4, 3, out0), ("propose", 4, 2)]
    # its observe: slot 0 accepted 1 (+1 bonus), slot 2 (first seen now) accepted 0: begins at length 3
    logits = torch.arange(2 * 4 * V, dtype=torch.float32).view(2, 4, V)
    after = rows([[1, 2, 3], [4, 5]], [[4, 0, 1], [1, 2]])
    d.observe([0, 2], [1, 0], TargetOutput(logits), state=after)
    assert made[2].calls[0] == ("begin", 3, 2, out2)
    assert made[0].calls[2][:3] == ("observe", 6, [1]) and made[2].calls[1][:3] == ("observe", 4, [0])
    assert torch.equal(made[0].calls[2][3], logits[:1]) and torch.equal(made[2].calls[1][3], logits[1:])
    # step 2: no begin again
    d.propose(DraftCall([2, 0], [1, 1], rows([[4, 5], [1, 2, 3]], [[1, 2], [4, 0, 1]]), [GREEDY] * 2))
    assert [c[0] for c in made[0].calls] == ["begin", "propose", "observe", "propose"]
    assert [c[0] for c in made[2].calls] == ["begin", "observe", "propose"]


def test_catch_up_sums_seconds_and_takes_the_longest_row():
    d = added(RequestSlots(lambda slot: Recorder(), num_slots=2, vocab_size=V), [0, 1], PROMPTS[:2])
    state = rows(PROMPTS[:2], EXTRA[:2])  # lengths 3 and 4
    first = d.propose(DraftCall([0, 1], [1, 1], state, [GREEDY] * 2))  # begins: the rows' lengths owed
    assert first.catch_up_tokens == 4 and first.catch_up_s >= 1.0
    again = d.propose(DraftCall([0, 1], [1, 1], state, [GREEDY] * 2))  # each instance: 0.5 s, its length
    assert again.catch_up_s == pytest.approx(1.0) and again.catch_up_tokens == 4


def test_add_drop_readd_and_reuse():
    built: list[Recorder] = []
    new = lambda slot: built.append(Recorder()) or built[-1]  # noqa: E731
    fresh = RequestSlots(new, num_slots=2, vocab_size=V)
    added(fresh, [1], [[1, 2]])
    first = fresh.instances[1]
    with pytest.raises(ValueError, match="in use"):
        fresh.add(1, [3], None)
    fresh.drop(1)
    assert fresh.instances[1] is None and fresh.idle == []
    with pytest.raises(ValueError, match="hold no request"):
        fresh.propose(DraftCall([1], [1], rows([[1, 2]], [[0]]), [GREEDY]))
    added(fresh, [1], [[3]])
    assert fresh.instances[1] is not first and len(built) == 2  # a new instance without reuse
    reused = RequestSlots(new, num_slots=2, vocab_size=V, reuse=True)
    added(reused, [0], [[1, 2]])
    kept = reused.instances[0]
    reused.propose(DraftCall([0], [1], rows([[1, 2]], [[0]]), [GREEDY]))
    reused.drop(0)
    assert reused.idle == [kept]
    added(reused, [1], [[4, 4, 4]])
    assert reused.instances[1] is kept and reused.idle == [] and len(built) == 3
    reused.propose(DraftCall([1], [1], rows([[4, 4, 4]], [[0]]), [GREEDY]))
    assert [c[:3] for c in kept.calls if c[0] == "begin"] == [("begin", 3, 2), ("begin", 4, 3)]


def test_request_slots_argument_errors():
    d = added(RequestSlots(lambda slot: Recorder(), num_slots=2, vocab_size=V), [0, 1], PROMPTS[:2])
    state = rows(PROMPTS[:2], EXTRA[:2])
    one = rows(PROMPTS[:1], EXTRA[:1])
    bad = [
        ([2], [1], dict(state=one, sampling=[GREEDY]), "slots must be an int"),
        ([0, 0], [1, 1], dict(state=state, sampling=[GREEDY] * 2), "distinct"),
        ([0, 1], [1], dict(state=state, sampling=[GREEDY] * 2), "one entry per slot"),
        ([0, 1], [1, -1], dict(state=state, sampling=[GREEDY] * 2), "depths must be ints"),
        ([0, 1], [1, 1], dict(state=state, sampling=[HOT] * 2, noise=PositionNoise([1])), "noise"),
    ]
    for slots, depths, kwargs, message in bad:
        with pytest.raises(ValueError, match=message):  # the call's own checks, or the drafter's
            d.propose(DraftCall(slots, depths, **kwargs))
    with pytest.raises(ValueError, match="call must be a DraftCall"):
        d.propose([0])
    features = TargetOutput(torch.zeros(2, 2, V))
    with pytest.raises(ValueError, match="one entry per slot"):
        d.observe([0, 1], [0], features, state=state)
    with pytest.raises(ValueError, match="num_accepted must be ints"):
        d.observe([0, 1], [0, -1], features, state=state)
    with pytest.raises(ValueError, match="slot must be an int"):
        d.add(2, [1], None)
    with pytest.raises(ValueError, match="prompt_ids"):
        RequestSlots(lambda slot: Recorder(), num_slots=1, vocab_size=V).add(0, [], None)
    with pytest.raises(ValueError, match="num_slots"):
        RequestSlots(lambda slot: Recorder(), num_slots=0, vocab_size=V)
    with pytest.raises(ValueError, match="vocab_size"):
        RequestSlots(lambda slot: Recorder(), num_slots=1, vocab_size=0)
    broken = RequestSlots(lambda slot: object(), num_slots=1, vocab_size=V)
    with pytest.raises(ValueError, match="not a Drafter"):
        broken.add(0, [1], None)
    assert broken.active == [False]  # the slot is free again

    class TooLong(Recorder):
        def propose(self, state, gamma, generator=None):
            return Proposal(torch.zeros(1, gamma + 1, dtype=torch.long))

    long = added(RequestSlots(lambda slot: TooLong(), num_slots=1, vocab_size=V, name="long"), [0], [[1]])
    with pytest.raises(ValueError, match="drafter long: .*more than the gamma"):
        long.propose(DraftCall([0], [2], rows([[1]], [[2]]), [GREEDY]))


# --- CohortSlots ------------------------------------------------------------------------------------
def test_cohort_slots_batched_equals_each_row_alone_and_the_keyed_drafter():
    drafter = DRAFT.as_drafter()
    batched = assert_rows_alone(lambda: CohortSlots(drafter, num_slots=4, vocab_size=V))
    state = rows(PROMPTS, EXTRA)
    for i in range(4):
        if DEPTHS[i]:
            sub = replace(state, sampling=SAMPLING[i])
            sub = DecodeState(sub.tokens_BL[i : i + 1], sub.prompt_lengths_B[i : i + 1],
                              sub.lengths_B[i : i + 1], sub.finished_B[i : i + 1], SAMPLING[i])  # fmt: skip
            direct = drafter.propose(sub, DEPTHS[i], None, noise=PositionNoise([SEEDS[i]]))
            assert torch.equal(direct.tokens_BK[0], row_of(batched, i)[0]), i


def test_cohort_slots_calls_once_per_cohort_and_observes_per_setting():
    seen: list[tuple] = []

    class Cohorts:
        batched_rows = True

        def begin(self, state, target_out):
            seen.append(("begin",))

        def propose(self, state, gamma, generator=None, *, noise=None):
            seen.append(("propose", state.lengths_B.tolist(), gamma, state.sampling, noise.seeds_B.tolist()))
            return Proposal(state.lengths_B[:, None].expand(-1, gamma) % V)

        def observe(self, state, num_accepted_B, target_out):
            seen.append(("observe", state.lengths_B.tolist(), state.sampling, num_accepted_B.tolist(),
                         target_out.logits_BTV[:, 0, 0].tolist()))  # fmt: skip

    d = added(CohortSlots(Cohorts(), num_slots=4, vocab_size=V), SLOTS, PROMPTS)
    assert d.name == "Cohorts" and d.keyed
    state = rows(PROMPTS, EXTRA)  # lengths 3, 4, 5, 5
    out = d.propose(DraftCall(SLOTS, [2, 0, 2, 2], state, [HOT, HOT, HOT, GREEDY], PositionNoise(SEEDS)))
    assert seen == [("propose", [3, 5], 2, HOT, [11, -5]), ("propose", [5], 2, GREEDY, [14])]
    assert out.counts_B == [2, 0, 2, 2] and out.tokens_T.tolist() == [3, 3, 5, 5, 5, 5]
    # point masses: the sampled rows' one-hot, the greedy row's zeros
    one_hot = torch.nn.functional.one_hot(torch.tensor([3, 3, 5, 5]), V).float()
    assert torch.equal(out.probs_TV, torch.cat([one_hot, torch.zeros(2, V)]))
    seen.clear()
    logits = torch.arange(4, dtype=torch.float32).view(4, 1, 1).expand(4, 2, V)
    d.observe(SLOTS, [1, 0, 0, 1], TargetOutput(logits), state=state)
    assert seen == [
        ("observe", [3, 4, 5], HOT, [1, 0, 0], [0.0, 1.0, 2.0]),
        ("observe", [5], GREEDY, [1], [3.0]),
    ]


def test_cohort_slots_needs_batched_rows():
    with pytest.raises(ValueError, match="batched_rows"):
        CohortSlots(Recorder(), num_slots=1, vocab_size=V)


# --- make_slot_drafter ------------------------------------------------------------------------------
def test_make_slot_drafter_resolves_names_and_objects(capsys):
    target = TARGET.as_target()
    ngram = make_slot_drafter(target, "ngram", {"max_ngram": 2}, num_slots=3)
    assert isinstance(ngram, NGramDrafter) and ngram.num_slots == 3
    default = make_slot_drafter(target, "default", num_slots=2)
    assert isinstance(default, NGramDrafter) and drafter_name(target, "default") == "ngram"
    assert "'default' -> 'ngram'" in capsys.readouterr().err
    assert make_slot_drafter(target, ngram, num_slots=3) is ngram  # a slot drafter object as it is
    markov = DRAFT.as_drafter()
    cohort = make_slot_drafter(target, markov, num_slots=2)
    assert isinstance(cohort, CohortSlots) and cohort.drafter is markov and cohort.name == "MarkovDrafter"
    model = ModelDrafter(
        TableTarget(random_table(V, seed=3)), num_slots=3, model=TableTarget(random_table(V, seed=4))
    )
    assert make_slot_drafter(target, model, num_slots=3) is model  # a slot drafter: as it is
    # any other object: itself first, deep copies while requests overlap (sharing the target), reuse
    plain = Recorder()
    plain.target = target
    copies = added(make_slot_drafter(target, plain, num_slots=3), [1, 2], [[1], [2]])
    assert isinstance(copies, RequestSlots) and copies.reuse and copies.name == "Recorder"
    assert copies.instances[1] is plain and copies.instances[2] is not plain
    assert copies.instances[2].target is target
    copies.drop(1)
    added(copies, [0], [[3]])
    assert copies.instances[0] is plain


def test_make_slot_drafter_builds_a_named_per_request_drafter_per_slot():
    """A registered one-request drafter: the first instance is built at once (bad options fail there)
    and serves the first request; every other slot gets its own."""
    built: list[dict] = []

    class Counted(Recorder):
        def __init__(self, target, *, weights=None):
            super().__init__()
            built.append({"weights": weights})

    DRAFTERS.register("counted-test", Counted)
    try:
        d = make_slot_drafter(TARGET.as_target(), "counted-test", {"weights": "w"}, num_slots=3)
        assert isinstance(d, RequestSlots) and d.name == "counted-test" and len(built) == 1
        added(d, [1, 0], [[1], [2]])
        assert len(built) == 2 and d.instances[0] is not d.instances[1]
        with pytest.raises(ValueError, match="has no option 'bogus'"):
            make_slot_drafter(TARGET.as_target(), "counted-test", {"bogus": 1}, num_slots=2)
    finally:
        DRAFTERS.unregister("counted-test")


def test_make_slot_drafter_errors():
    target = TARGET.as_target()
    with pytest.raises(ValueError, match="num_slots must be an int >= 1"):
        make_slot_drafter(target, "ngram", num_slots=0)
    with pytest.raises(ValueError, match="unknown drafter 'nope'; known drafters: .*bigram"):
        make_slot_drafter(target, "nope", num_slots=1)
    with pytest.raises(ValueError, match="must not set 'num_slots'"):
        make_slot_drafter(target, "bigram", {"num_slots": 1}, num_slots=2)
    with pytest.raises(ValueError, match="only apply when drafter is given by name"):
        make_slot_drafter(target, DRAFT.as_drafter(), {"x": 1}, num_slots=2)
    with pytest.raises(ValueError, match="has 2 slots, the engine needs 3"):
        make_slot_drafter(target, NGramDrafter(target, num_slots=2), num_slots=3)
    with pytest.raises(ValueError, match="begin/propose/observe, got int"):
        make_slot_drafter(target, 3, num_slots=1)
    with pytest.raises(ValueError, match="has no option 'bogus'"):
        make_slot_drafter(target, "ngram", {"bogus": 1}, num_slots=1)


# --- eagle-tree with a tiny head (the fixture of tests/test_eagle_slots.py) ------------------------------
def test_eagle_tree_by_name_rows_equal_alone(tiny):  # noqa: F811
    """``eagle-tree``: two rows drafted in one call each get their own tree (``trees``, verified alone)
    and its main path as the chain, equal to the row alone, where the call's proposal is its tree."""
    tiny_eagle = tiny
    target = tiny_eagle["target"]
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8] * 2, [20, 21, 22] * 4]
    options = {"weights": tiny_eagle["weights"]}
    make = lambda: make_slot_drafter(target, "eagle-tree", options, num_slots=2)  # noqa: E731
    d = make()  # its head captures layer 0 of the target
    outs = []
    for p in prompts:
        target.reset(1, 64)
        outs.append(target.forward(torch.tensor([p]), torch.zeros(1, dtype=torch.long)))
    for s, p, o in zip([1, 0], prompts, outs, strict=True):
        d.add(s, p, o)
    assert isinstance(d, EagleDrafter) and d.tree_mode == "always"
    state = rows(prompts, [[5], [6]])
    sampling, seeds, depths = [GREEDY, HOT], [5, 6], [3, 2]
    together = d.propose(DraftCall([1, 0], depths, state, sampling, PositionNoise(seeds)))
    assert together.tree is None and all(0 < n <= k for n, k in zip(together.counts_B, depths, strict=True))
    assert [index for index, _ in together.trees] == [[0], [1]]
    for i, s in enumerate([1, 0]):
        alone = make()
        alone.add(s, prompts[i], outs[i])
        solo = alone.propose(
            DraftCall(
                [s],
                [depths[i]],
                rows([prompts[i]], [[[5], [6]][i]]),
                [sampling[i]],
                PositionNoise([seeds[i]]),
            )
        )
        assert solo.tree is not None and solo.tree.tree is not None  # a lone row's token tree
        assert torch.equal(solo.tokens_T, solo.tree.tokens_BK[0])
        tokens, probs = row_of(together, i)
        assert solo.counts_B == [together.counts_B[i]] and torch.equal(solo.tokens_T, tokens), i
        if sampling[i].greedy:
            assert solo.probs_TV is None and not probs.any()
        else:
            assert torch.equal(solo.probs_TV, probs) and torch.equal(solo.probs_TV, solo.tree.probs_BKV[0])


def test_an_engine_that_fails_to_build_hands_the_target_back():
    """A drafter object with fewer slots than the engine's rows is refused after the engine claimed the
    target's cache; the next engine on that target then builds and runs."""
    from specdec.engine import Engine

    target = TARGET.as_target()
    with pytest.raises(ValueError, match="has 1 slots, the engine needs 2") as failed:
        Engine(target, drafter=NGramDrafter(target, num_slots=1), gamma=2, max_num_seqs=2)
    assert failed.traceback  # its frames keep the half-built engine alive
    engine = Engine(target, drafter="ngram", gamma=2, max_num_seqs=2)
    engine.add_request([1, 2, 3], max_new_tokens=4, temperature=0.0, ignore_eos=True)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats["steps"] > 0
