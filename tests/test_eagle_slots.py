"""The EAGLE slot drafter (:mod:`specdec.drafters.eagle.slots`): one instance per engine, state per slot.

A batched ``propose`` over several slots gives each row bitwise the drafts and draft probabilities it
gets alone (ragged catch-up blocks, mixed depths and sampling settings); in the engine, requests that
arrive and leave at every step get the tokens they get alone, greedy and seeded sampled, and a step
runs one head forward per draft position for all its drafting rows.

A tiny random Llama (``tests/_tiny.py``) and an untrained EAGLE-3-style head for it (aux layer 0 fused
in, previous-token input: the shipped head's shape).

Legend: G rows, P prompt tokens, D hidden size.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _engine_drive import Arrival, drive
from _tiny import save_tiny_checkpoint

import specdec
from specdec.drafters.eagle import EagleConfig, EagleDrafter, EagleHead, save_eagle_head
from specdec.engine import Engine
from specdec.protocols import DecodeState, DraftCall, SlotDrafter
from specdec.sampling import SamplingParams
from specdec.targets.llama import LlamaTarget
from specdec.verify.noise import PositionNoise

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8] * 3, [20, 21, 22] * 6, [9, 40, 17, 3, 250, 8], [30, 31] * 9, [7] * 5]
MAX_LEN = 128


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Any]:
    """A tiny Llama target, a head file for it, and each prompt decoded alone with no drafter."""
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("slots") / "tiny", seed=3)
    target = LlamaTarget.from_pretrained(path)
    parts = target.parts()
    target.reset(1, 32)
    out = target.forward(torch.tensor([list(range(3, 27))]), torch.zeros(1, dtype=torch.long))
    config = EagleConfig.from_hf_config(
        target.config,
        draft_vocab_size=200,
        feature_scale=1 / float(out.hidden_BTD.std()),
        embed_scale=1 / float(parts.embed_VD.std()),
        aux_layers=(0,),
        aux_scales=(1.0,),
        prev_token_input=True,
    )
    torch.manual_seed(0)
    head = EagleHead(config)
    torch.nn.init.normal_(head.fc_aux.weight, std=0.05)
    head.draft_vocab_N = torch.arange(200)
    head.attach(parts)
    weights = str(tmp_path_factory.mktemp("head") / "head.safetensors")
    save_eagle_head(head, weights, target_name="tiny", embed_VD=parts.embed_VD)
    return {"target": target, "weights": weights}


def prefill(target: LlamaTarget, prompt: list[int]):
    target.reset(1, MAX_LEN)
    return target.forward(torch.tensor([prompt]), torch.zeros(1, dtype=torch.long))


def rows_state(prompts: list[list[int]], first: list[int]) -> DecodeState:
    """The rows after their first token: prompt + ``first[i]``."""
    tokens = torch.zeros(len(prompts), MAX_LEN, dtype=torch.long)
    for i, (p, x) in enumerate(zip(prompts, first, strict=True)):
        tokens[i, : len(p) + 1] = torch.tensor(p + [x])
    P = torch.tensor([len(p) for p in prompts])
    return DecodeState(tokens, P, P + 1, torch.zeros(len(prompts), dtype=torch.bool))


GREEDY = SamplingParams(temperature=0.0)
HOT = SamplingParams(temperature=0.8, top_k=20)
WARM = SamplingParams(temperature=1.0)


def test_batched_propose_equals_each_slot_alone_bitwise(tiny):
    """Ragged catch-up (prompts of 6 to 24 tokens), mixed depths (0 to 4) and sampling settings at
    slots given out of order: every row's tokens and probabilities equal its own solo proposal, at the
    first and at a second call (drafting on from its own predicted features)."""
    target = tiny["target"]
    prompts, first = PROMPTS[:4], [5, 6, 7, 8]
    slots, depths = [3, 0, 2, 1], [4, 3, 0, 2]
    sampling, seeds = [GREEDY, HOT, HOT, WARM], [11, 12, 13, 14]
    together = EagleDrafter(target, num_slots=4, weights=tiny["weights"])  # captures layer 0
    outs = [prefill(target, p) for p in prompts]
    assert isinstance(together, SlotDrafter)
    for s, p, o in zip(slots, prompts, outs, strict=True):
        together.add(s, p, o)
    state = rows_state(prompts, first)
    noise = PositionNoise(seeds)
    batched = [together.propose(DraftCall(slots, depths, state, sampling, noise)) for _ in range(2)]
    for i in range(4):
        alone = EagleDrafter(target, num_slots=4, weights=tiny["weights"], head=together.head)
        alone.add(slots[i], prompts[i], outs[i])
        one = rows_state([prompts[i]], [first[i]])
        for call in batched:
            solo = alone.propose(
                DraftCall([slots[i]], [depths[i]], one, [sampling[i]], PositionNoise([seeds[i]]))
            )
            assert solo.counts_B == [call.counts_B[i]] == [depths[i]]
            start = sum(call.counts_B[:i])
            assert torch.equal(solo.tokens_T, call.tokens_T[start : start + depths[i]])
            if not sampling[i].greedy and depths[i]:
                assert torch.equal(solo.probs_TV, call.probs_TV[start : start + depths[i]])
    assert batched[0].probs_TV[: depths[0]].abs().sum() == 0  # the greedy row: point mass, zeros here


def test_lookup_first_slots_equal_each_slot_alone(tiny):
    """``ngram-eagle``'s slot drafter: rows whose text repeats take the lookup's tokens (point masses),
    the others the head's chain, all in one call; every row's tokens and probabilities equal its solo
    proposal, and the lookup rows are exactly the lookup's tokens."""
    from specdec.drafters.ngram import lookup
    from specdec.drafters.ngram_eagle import ngram_eagle

    target = tiny["target"]
    prompts, first = [PROMPTS[0], PROMPTS[2], PROMPTS[1], [9, 40, 17, 3, 250]], [1, 5, 20, 6]
    slots, depths = [2, 0, 3, 1], [3, 3, 2, 4]
    sampling, seeds = [GREEDY, HOT, HOT, GREEDY], [1, 2, 3, 4]
    together = ngram_eagle(target, num_slots=4, weights=tiny["weights"])
    assert isinstance(together, SlotDrafter)
    outs = [prefill(target, p) for p in prompts]
    for s, p, o in zip(slots, prompts, outs, strict=True):
        together.add(s, p, o)
    state = rows_state(prompts, first)
    call = together.propose(DraftCall(slots, depths, state, sampling, PositionNoise(seeds)))
    assert together.counts["lookup"] == 2 and together.counts["head"] == 2  # rows 0, 2 repeat
    for i in range(4):
        alone = ngram_eagle(target, num_slots=4, head=together.head)
        alone.add(slots[i], prompts[i], outs[i])
        one = rows_state([prompts[i]], [first[i]])
        solo = alone.propose(
            DraftCall([slots[i]], [depths[i]], one, [sampling[i]], PositionNoise([seeds[i]]))
        )
        start, n = sum(call.counts_B[:i]), call.counts_B[i]
        assert solo.counts_B == [n] and torch.equal(solo.tokens_T, call.tokens_T[start : start + n])
        if not sampling[i].greedy:
            assert torch.equal(solo.probs_TV, call.probs_TV[start : start + n])
        if i in (0, 2):
            found = lookup(
                one.tokens_BL[0, : len(prompts[i]) + 1], depths[i], max_ngram=3, min_ngram=2, search="latest"
            )
            assert n > 0 and torch.equal(call.tokens_T[start : start + n], found)
    row2 = call.probs_TV[sum(call.counts_B[:2]) : sum(call.counts_B[:3])]  # a sampled lookup row
    assert torch.equal(row2.sum(-1), torch.ones(len(row2))) and row2.max() == 1


def test_auto_drafts_trees_for_a_lone_greedy_row(tiny):
    """``ngram-eagle-auto``: a request alone in the engine (trees pay: no cost model) drafts token trees
    on its slot of the shared head cache, and emits what plain decoding does."""
    e = engine(tiny, "ngram-eagle-auto")
    settings = greedy(0, 24)
    got = drive(e, [Arrival(0, "a", PROMPTS[2], settings)])["a"].token_ids
    assert e.drafter.counts["tree"] > 0
    assert got == specdec.generate(tiny["target"], [PROMPTS[2]], drafter="none", **settings).token_ids[0]


def test_one_head_forward_per_draft_position_for_all_rows(tiny, monkeypatch):
    """Three rows at depth 3: one catch-up forward and two chain forwards, each over every row."""
    target = tiny["target"]
    drafter = EagleDrafter(target, num_slots=3, weights=tiny["weights"])
    for s, p in enumerate(PROMPTS[:3]):
        drafter.add(s, p, prefill(target, p))
    calls = []
    inner = drafter._head_block
    monkeypatch.setattr(drafter, "_head_block", lambda rows, *a: calls.append(len(rows)) or inner(rows, *a))
    state = rows_state(PROMPTS[:3], [5, 6, 7])
    proposal = drafter.propose(DraftCall([0, 1, 2], [3, 3, 3], state, [GREEDY] * 3))
    assert proposal.counts_B == [3, 3, 3] and calls == [3, 3, 3]


def test_protocol_boundary_checks(tiny):
    target = tiny["target"]
    drafter = EagleDrafter(target, num_slots=2, weights=tiny["weights"])  # captures layer 0
    out = prefill(target, PROMPTS[4])
    with pytest.raises(ValueError, match="slot must be an int in"):
        drafter.add(2, PROMPTS[4], out)
    with pytest.raises(ValueError, match="num_slots"):
        EagleDrafter(target, num_slots=0, weights=tiny["weights"])
    drafter.add(0, PROMPTS[4], out)
    with pytest.raises(ValueError, match="in use"):
        drafter.add(0, PROMPTS[4], out)
    state = rows_state([PROMPTS[4]], [5])
    with pytest.raises(ValueError, match="hold no request"):
        drafter.propose(DraftCall([1], [2], state, [GREEDY]))
    with pytest.raises(ValueError, match="noise"):
        drafter.propose(DraftCall([0], [2], state, [HOT]))
    drafter.drop(0)
    drafter.add(0, PROMPTS[4], out)  # a dropped slot takes the next request


def _eagle_of(drafter: Any) -> EagleDrafter:
    """The EAGLE slot drafter itself, or the one inside a lookup-first slot drafter."""
    return getattr(drafter, "eagle", None) if not isinstance(drafter, EagleDrafter) else drafter


def churn(settings) -> list[Arrival]:
    """Five requests on three rows, arriving at steps 0..4 with different lengths: every step some
    request joins or leaves, and rows are reused."""
    lengths = [9, 4, 12, 5, 7]
    return [Arrival(i, i, PROMPTS[i], settings(i, n)) for i, n in enumerate(lengths)]


def assert_solo_tokens(finals: dict, settings, target: Any, alone_engine) -> None:
    """Each churned request's tokens (``finals``): a greedy one equals plain decoding alone, a seeded
    sampled one equals itself alone in an engine of its own (``alone_engine()``)."""
    for a in churn(settings):
        if settings is greedy:
            alone = specdec.generate(target, [a.prompt], drafter="none", **a.settings).token_ids[0]
        else:
            alone = drive(alone_engine(), [Arrival(0, a.key, a.prompt, a.settings)])[a.key].token_ids
        assert finals[a.key].token_ids == alone, a.key
        assert len(alone) == a.settings["max_new_tokens"]


def greedy(i: int, n: int) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}


def sampled(i: int, n: int) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0.8, "top_k": 20, "seed": 100 + i, "ignore_eos": True}


def engine(tiny, drafter: str = "eagle", **options: Any) -> Engine:
    settings = dict(
        drafter=drafter,
        drafter_options={"weights": tiny["weights"]},
        gamma=3,
        max_num_seqs=3,
        max_model_len=MAX_LEN,
        measure_cost=False,
    )
    return Engine(tiny["target"], **{**settings, **options})


@pytest.mark.parametrize("drafter", ["eagle", "ngram-eagle", "ngram-eagle-auto"])
@pytest.mark.parametrize("settings", [greedy, sampled])
def test_requests_arriving_and_leaving_every_step_get_their_solo_tokens(tiny, settings, drafter):
    """The engine's one slot drafter, slots added and dropped at every step: greedy requests equal
    plain decoding alone, seeded sampled requests equal themselves alone in an engine of their own."""
    together = engine(tiny, drafter)
    assert together.drafter is not None
    finals = drive(together, churn(settings))
    assert not any(_eagle_of(together.drafter).active)  # every slot dropped
    # the prompts' catch-up is owed once per request: counted apart, inside the drafters' time
    assert 0.0 < together.stats["owed_s"] <= together.stats["draft_s"]
    assert_solo_tokens(finals, settings, tiny["target"], lambda: engine(tiny, drafter))


def test_aborted_request_gives_back_its_slot(tiny):
    e = engine(tiny, max_num_seqs=2)
    first = e.add_request(PROMPTS[0], max_new_tokens=20, temperature=0.0, ignore_eos=True)
    e.step()
    e.step()
    slot = e.requests[first].slot
    assert e.drafter.active[slot]
    e.abort(first)
    assert not e.drafter.active[slot]
    second = drive(e, [Arrival(0, "b", PROMPTS[1], greedy(1, 6))])["b"].token_ids
    alone = specdec.generate(tiny["target"], [PROMPTS[1]], drafter="none", **greedy(1, 6)).token_ids[0]
    assert second == alone


def test_the_engine_measures_batched_drafting_before_the_first_request(tiny):
    """With a cost model, the engine times its slot drafter once at every row count of the verify grid
    (slots added, drafted, dropped; the target's rows rolled back), and requests then decode as alone."""
    e = engine(tiny, "ngram-eagle", measure_cost=True, gamma="auto")
    assert set(e.scheduler.draft_cost.position) == set(e.scheduler.cost.rows) == {1, 2, 3}
    assert all(v > 0 for v in e.scheduler.draft_cost.position.values())
    assert not any(_eagle_of(e.drafter).active)
    finals = drive(e, churn(greedy))
    for a in churn(greedy):
        alone = specdec.generate(tiny["target"], [a.prompt], drafter="none", **a.settings).token_ids[0]
        assert finals[a.key].token_ids == alone, a.key
