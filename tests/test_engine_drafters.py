"""The engine with drafters that run a model (``model``, ``qself``, ``layerskip``): each request's
drafter runs at its request's cache row, beside the others, with the heavy part (the draft model,
the int4 copy) loaded once.

Greedy requests arriving at different steps equal their solo plain decoding; a seeded sampled request
repeats on a new engine and equals itself alone; drafts of a draft model equal to the target are
all accepted under load (so no row reads another's cache); layerskip's draft keys/values are
overwritten by the verify block; ``forward_layers`` over ``rows_B`` touches only those rows.

A tiny random Llama (``tests/_tiny.py``) with a dead last layer (its attention output and MLP down
projections are zero), so the early exit before it predicts what the whole model does.

Legend: B rows, T block tokens, L cache slots, N new tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _engine_drive import Arrival, drive
from _tiny import byte_tokenizer, save_tiny_checkpoint, tiny_llama

import specdec
from specdec.drafters.engine_drafter import make_slot_drafter
from specdec.drafters.layerskip import LayerSkipDrafter
from specdec.drafters.model import ModelDrafter
from specdec.engine import Engine, RequestOutput
from specdec.engine.request import RequestStatus
from specdec.protocols import DecodeState, DraftCall
from specdec.sampling import SamplingParams
from specdec.targets.llama import LlamaTarget

pytestmark = pytest.mark.usefixtures("one_thread")

DEPTH = 3  # layers of the tiny target; layer DEPTH - 1 adds nothing
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8] * 3, [20, 21, 22] * 5, [9, 8, 7, 6] * 4]
LENGTHS = [24, 8, 20]  # new tokens per request
MAX_LEN = 96


def greedy(n: int) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}


def sampled(seed: int, n: int = 16) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0.8, "top_k": 20, "seed": seed, "ignore_eos": True}


def dead_last_layer_checkpoint(path: Path, *, seed: int) -> Path:
    """A tiny Llama whose last layer adds zero to the residual stream (and its tokenizer)."""
    model = tiny_llama(num_layers=DEPTH, init_std=0.2, seed=seed)
    last = model.model.layers[-1]
    with torch.no_grad():
        last.self_attn.o_proj.weight.zero_()
        last.mlp.down_proj.weight.zero_()
    model.save_pretrained(path, safe_serialization=True)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine-drafters")
    return {
        "target": dead_last_layer_checkpoint(root / "target", seed=3),
        "other": save_tiny_checkpoint(root / "other", num_layers=2, init_std=0.2, seed=4),
    }


@pytest.fixture(scope="module")
def target(paths) -> LlamaTarget:
    return LlamaTarget.from_pretrained(paths["target"])  # fp32 weights, as qself needs


@pytest.fixture(scope="module")
def solo(target) -> list[list[int]]:
    """Each prompt decoded alone with no drafter."""
    return [
        specdec.generate(
            target, [p], drafter="none", max_new_tokens=n, temperature=0.0, ignore_eos=True
        ).token_ids[0]
        for p, n in zip(PROMPTS, LENGTHS, strict=True)
    ]


DRAFTERS = {
    "model-same": ("model", lambda paths: {"model": str(paths["target"]), "backend": "llama"}),
    "model-other": ("model", lambda paths: {"model": str(paths["other"]), "backend": "llama"}),
    "model-hf": ("model", lambda paths: {"model": str(paths["other"]), "backend": "hf"}),
    "qself": ("qself", lambda paths: {}),
    "layerskip": ("layerskip", lambda paths: {"num_layers": DEPTH - 1}),
}
"""Name -> (drafter, its options). ``model-same`` drafts with the target's own weights and
``layerskip`` stops before the dead layer: both predict the target exactly."""
EXACT_DRAFTS = ("model-same", "layerskip")


def make_engine(target, paths, which: str, **options: Any) -> Engine:
    name, drafter_options = DRAFTERS[which]
    settings = {"gamma": 3, "max_num_seqs": 2, "max_model_len": MAX_LEN, "measure_cost": False}
    return Engine(target, drafter=name, drafter_options=drafter_options(paths), **{**settings, **options})


def staggered(settings: list[dict[str, Any]]) -> list[Arrival]:
    """Three requests at steps 0, 1 and 3 on two rows: the third takes the second's row."""
    return [
        Arrival(step, i, PROMPTS[i], s) for i, (step, s) in enumerate(zip((0, 1, 3), settings, strict=True))
    ]


@pytest.mark.parametrize("which", list(DRAFTERS))
def test_greedy_under_load_equals_solo_with_shared_draft_parts(target, paths, solo, which, monkeypatch):
    """Three greedy requests joining at different steps (two rows, one reused): each gets exactly its
    solo tokens; the heavy part is built once and every instance drafts through it."""
    from specdec.targets import llama_weights

    copies = []
    requantized = llama_weights.requantized
    monkeypatch.setattr(
        llama_weights, "requantized", lambda *a, **k: copies.append(1) or requantized(*a, **k)
    )
    engine = make_engine(target, paths, which)
    drafters, slots = {}, set()

    def after_step(step: int, outputs: list[RequestOutput]) -> None:
        for r in engine.running:
            if r.status is RequestStatus.DECODE:
                drafters[r.request_id] = engine.drafter
                slots.add((r.request_id, r.slot))

    finals = drive(engine, staggered([greedy(n) for n in LENGTHS]), after_step=after_step)
    for i in range(3):
        assert finals[i].token_ids == solo[i], f"request {i}"
    assert len({slot for _, slot in slots}) == 2  # two rows, three requests: one row reused
    one = engine.drafter  # one slot drafter for every request
    assert all(d is one for d in drafters.values()) and not any(one.active)  # every slot dropped
    if which == "layerskip":  # the target's own first layers, at each request's row of its cache
        assert isinstance(one, LayerSkipDrafter) and one.target is target
    else:  # model, qself: one draft model with a cache row per engine slot
        assert isinstance(one, ModelDrafter)
        assert one.num_slots == 2 and one.cached == [0, 0]  # a draft-cache row per engine slot, freed
        assert one.draft is not target
    assert len(copies) == (1 if which == "qself" else 0)  # the int4 copy is built once
    drafted = sum(f.metrics.num_drafted for f in finals.values())
    accepted = sum(f.metrics.num_accepted for f in finals.values())
    assert drafted > 0
    if which in EXACT_DRAFTS:  # a row that read another row's cache would draft other tokens
        assert accepted >= 0.95 * drafted, (accepted, drafted)


@pytest.mark.parametrize("which", list(DRAFTERS))
def test_seeded_sampling_repeats_and_equals_alone(target, paths, which):
    """A seeded sampled request emits the same tokens alone, under load, and on a second engine
    (``exact`` verification: its drafts, hence its tokens, depend on its own row only)."""
    settings = [sampled(41), greedy(8), sampled(43)]
    alone = drive(make_engine(target, paths, which), [Arrival(0, 0, PROMPTS[0], settings[0])])[0]
    first = drive(make_engine(target, paths, which), staggered(settings))
    again = drive(make_engine(target, paths, which), staggered(settings))
    assert len(alone.token_ids) == 16
    assert first[0].token_ids == alone.token_ids
    for i in (0, 2):
        assert again[i].token_ids == first[i].token_ids, f"request {i}"
        assert again[i].metrics.num_accepted == first[i].metrics.num_accepted
    assert first[0].token_ids != first[2].token_ids
    if which in EXACT_DRAFTS:  # draft distribution = target distribution: always accepted
        assert first[0].metrics.num_accepted == first[0].metrics.num_drafted > 0


def test_layerskip_draft_slots_are_overwritten_by_verify(target, paths):
    """After every step, each decoding row's cached keys/values (its committed tokens but the last)
    equal a fresh prefill of those tokens: the early-exit drafts written past the row's length never
    survive the verify block."""
    fresh = LlamaTarget.from_pretrained(paths["target"])
    checked = []

    def after_step(step: int, outputs: list[RequestOutput]) -> None:
        for r in engine.running:
            if r.status is not RequestStatus.DECODE:
                continue
            n = r.length - 1
            assert int(target.cache.lengths_B[r.slot]) == n
            fresh.reset(1, MAX_LEN)
            fresh.forward(engine.tokens_SL[r.slot : r.slot + 1, :n], torch.zeros(1, dtype=torch.long))
            for cache, ref in (
                (target.cache.k_NBHLD, fresh.cache.k_NBHLD),
                (target.cache.v_NBHLD, fresh.cache.v_NBHLD),
            ):
                torch.testing.assert_close(cache[:, r.slot, :, :n], ref[:, 0, :, :n], atol=1e-5, rtol=1e-4)
            checked.append(n)

    engine = make_engine(target, paths, "layerskip")
    drive(engine, staggered([greedy(n) for n in LENGTHS]), after_step=after_step)
    assert len(checked) > 10


def test_forward_layers_over_rows_touches_those_rows_only(target):
    """``forward_layers(rows_B=[r])`` on a 3-row cache gives row r what a 1-row cache gives and
    writes no other row."""
    g = torch.Generator().manual_seed(0)
    tokens_3T = torch.randint(0, 256, (3, 10), generator=g)
    target.reset(3, 32)
    target.forward(tokens_3T, torch.zeros(3, dtype=torch.long))
    before_k = target.cache.k_NBHLD.clone()
    block_12 = torch.tensor([[7, 8]])
    out = target.forward_layers(block_12, torch.tensor([10]), num_layers=2, rows_B=torch.tensor([1]))
    assert torch.equal(target.cache.lengths_B, torch.tensor([10, 10, 10]))  # lengths untouched
    others = [0, 2]
    assert torch.equal(target.cache.k_NBHLD[:, others], before_k[:, others])
    assert torch.equal(target.cache.k_NBHLD[:, 1, :, :10], before_k[:, 1, :, :10])
    assert not torch.equal(target.cache.k_NBHLD[:2, 1, :, 10:12], before_k[:2, 1, :, 10:12])
    target.reset(1, 32)
    target.forward(tokens_3T[1:2], torch.zeros(1, dtype=torch.long))
    alone = target.forward_layers(block_12, torch.tensor([10]), num_layers=2)
    torch.testing.assert_close(out.logits_BTV, alone.logits_BTV, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="rows_B"):
        target.forward_layers(block_12, torch.tensor([10]), num_layers=2, rows_B=torch.tensor([1]))


@pytest.mark.parametrize("kind", ["model", "layerskip"])
def test_generate_with_a_drafter_object_runs_one_instance_per_row(target, paths, solo, kind):
    """A ModelDrafter or LayerSkipDrafter given as an object is the engine's slot drafter itself (one
    draft model, a cache row per request): solo tokens, all drafts taken."""
    if kind == "model":
        d = ModelDrafter(target, num_slots=len(PROMPTS), model=str(paths["target"]), backend="llama")
    else:
        d = LayerSkipDrafter(target, num_slots=len(PROMPTS), num_layers=DEPTH - 1)
    n = min(LENGTHS)
    out = specdec.generate(
        target, PROMPTS, drafter=d, max_new_tokens=n, gamma=3, temperature=0.0, ignore_eos=True
    )
    assert out.token_ids == [ref[:n] for ref in solo]
    assert out.metrics.num_proposed > 0 and out.metrics.acceptance_rate >= 0.95


def test_bad_slot_options(target, paths):
    class NoSlots:  # a Target without rows_B
        vocab_size = target.vocab_size
        eos_token_ids = ()

        def reset(self, batch_size, max_len): ...

        def forward(self, tokens_BT, start_B, *, logits_index_BN=None): ...

        def rollback(self, lengths_B): ...

    with pytest.raises(ValueError, match="slot API"):
        ModelDrafter(NoSlots(), model=NoSlots())
    with pytest.raises(ValueError, match="num_slots must be an int"):
        ModelDrafter(target, num_slots=0, model=str(paths["other"]), backend="llama")
    with pytest.raises(ValueError, match="num_slots must be an int"):
        LayerSkipDrafter(target, num_layers=1, num_slots=0)
    with pytest.raises(ValueError, match="no option 'slot'"):  # the engine's drafter keeps every slot
        make_slot_drafter(target, "layerskip", {"slot": 1}, num_slots=2)
    with pytest.raises(ValueError, match="must not set 'num_slots'"):
        make_slot_drafter(target, "layerskip", {"num_slots": 1}, num_slots=2)
    with pytest.raises(ValueError, match="num_slots"):
        make_slot_drafter(target, "layerskip", None, num_slots=0)


def _rows(prompts: list[list[int]], first: list[int], extra: list[list[int]]) -> DecodeState:
    """Rows after their first token and ``extra[i]`` committed tokens more (prompt + first + extra)."""
    tokens = torch.zeros(len(prompts), MAX_LEN, dtype=torch.long)
    for i, (p, x, e) in enumerate(zip(prompts, first, extra, strict=True)):
        tokens[i, : len(p) + 1 + len(e)] = torch.tensor(p + [x] + e)
    P = torch.tensor([len(p) for p in prompts])
    n = torch.tensor([len(p) + 1 + len(e) for p, e in zip(prompts, extra, strict=True)])
    return DecodeState(tokens, P, n, torch.zeros(len(prompts), dtype=torch.bool))


def test_model_slot_drafter_batched_equals_each_row_alone(target, paths):
    """One draft forward per position over every row: ragged committed runs (a row 3 tokens behind),
    mixed depths (0 to 4) and sampling settings at slots out of order give each row bitwise its solo
    tokens and draft probabilities; ``observe`` rolls every row back; a dropped slot takes another."""
    from specdec.verify.noise import PositionNoise

    greedy_p, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=20)
    prompts, first, extra = PROMPTS, [5, 6, 7], [[], [9, 9, 9], [4]]
    slots, depths, sampling, seeds = [2, 0, 1], [4, 3, 0], [greedy_p, hot, hot], [11, 12, 13]
    model = str(paths["other"])
    together = ModelDrafter(target, num_slots=3, model=model, backend="llama", capacity=MAX_LEN)
    for s, p in zip(slots, prompts, strict=True):
        together.add(s, p, None)
    state = _rows(prompts, first, extra)
    call = together.propose(DraftCall(slots, depths, state, sampling, PositionNoise(seeds)))
    assert call.counts_B == depths
    for i in range(3):
        alone = ModelDrafter(target, num_slots=3, model=model, backend="llama", capacity=MAX_LEN)
        alone.add(slots[i], prompts[i], None)
        one = _rows([prompts[i]], [first[i]], [extra[i]])
        solo = alone.propose(
            DraftCall([slots[i]], [depths[i]], one, [sampling[i]], PositionNoise([seeds[i]]))
        )
        start = sum(call.counts_B[:i])
        assert torch.equal(solo.tokens_T, call.tokens_T[start : start + depths[i]])
        if not sampling[i].greedy and depths[i]:
            assert torch.equal(solo.probs_TV, call.probs_TV[start : start + depths[i]])
    before = [together.cached[s] for s in slots]  # the drafting rows fed their drafts; row 2 lags
    assert before[2] == len(prompts[2]) and before[0] == len(prompts[0]) + depths[0]
    lengths = state.lengths_B + 1  # one more token committed per row: every draft rejected
    state.lengths_B = lengths
    together.observe(slots, [0, 0, 0], None, state=state)
    assert [together.cached[s] for s in slots] == [
        min(c, n - 1) for c, n in zip(before, lengths.tolist(), strict=True)
    ]
    with pytest.raises(ValueError, match="in use"):
        together.add(0, PROMPTS[0], None)
    together.drop(0)
    together.add(0, PROMPTS[2], None)
    with pytest.raises(ValueError, match="hold no request"):
        ModelDrafter(target, num_slots=1, model=model, backend="llama").propose(
            DraftCall([0], [1], _rows([PROMPTS[0]], [1], [[]]), [greedy_p])
        )
    with pytest.raises(ValueError, match="noise"):
        together.propose(DraftCall([0], [1], _rows([PROMPTS[2]], [1], [[]]), [hot]))


def test_layerskip_slot_drafter_batched_equals_each_row_alone(target):
    """One early-exit forward per position over every row, each at its own cache row: mixed depths and
    sampling settings at slots out of order give each row bitwise its solo tokens and probabilities."""
    from specdec.verify.noise import PositionNoise

    greedy_p, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=20)
    prompts, first = PROMPTS, [5, 6, 7]
    slots, depths, sampling, seeds = [2, 0, 1], [3, 2, 0], [greedy_p, hot, hot], [11, 12, 13]

    def prefilled(rows: list[int], ps: list[list[int]]) -> None:
        target.reset(3, MAX_LEN)
        for r, p, x in zip(rows, ps, first, strict=False):
            target.forward(
                torch.tensor([p + [x]]), torch.zeros(1, dtype=torch.long), rows_B=torch.tensor([r])
            )
            target.rollback(torch.tensor([len(p)]), rows_B=torch.tensor([r]))

    together = LayerSkipDrafter(target, num_slots=3, num_layers=DEPTH - 1)
    prefilled(slots, prompts)
    for s_, p in zip(slots, prompts, strict=True):
        together.add(s_, p, None)
    call = together.propose(
        DraftCall(slots, depths, _rows(prompts, first, [[], [], []]), sampling, PositionNoise(seeds))
    )
    assert call.counts_B == depths
    for i in range(3):
        alone = LayerSkipDrafter(target, num_slots=3, num_layers=DEPTH - 1)
        target.reset(3, MAX_LEN)
        target.forward(
            torch.tensor([prompts[i] + [first[i]]]),
            torch.zeros(1, dtype=torch.long),
            rows_B=torch.tensor([slots[i]]),
        )
        target.rollback(torch.tensor([len(prompts[i])]), rows_B=torch.tensor([slots[i]]))
        alone.add(slots[i], prompts[i], None)
        solo = alone.propose(
            DraftCall(
                [slots[i]],
                [depths[i]],
                _rows([prompts[i]], [first[i]], [[]]),
                [sampling[i]],
                PositionNoise([seeds[i]]),
            )
        )
        start = sum(call.counts_B[:i])
        assert torch.equal(solo.tokens_T, call.tokens_T[start : start + depths[i]])
        if not sampling[i].greedy and depths[i]:
            assert torch.equal(solo.probs_TV, call.probs_TV[start : start + depths[i]])
    with pytest.raises(ValueError, match="num_layers"):
        LayerSkipDrafter(target, num_slots=2, num_layers=DEPTH)
