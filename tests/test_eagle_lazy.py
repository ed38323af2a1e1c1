"""The EAGLE head's lazy catch-up (:mod:`specdec.drafters.eagle.queue`): a step where the head does
not draft (depth 0, or prompt lookup proposed) runs no head layer; the queued features run in one
block when the head next drafts, and the drafts are those of a head that caught up at every step.

A tiny random Llama and an untrained head built on it (its drafts are rarely accepted, which does
not matter here: the drafts and the outputs are compared, not the speed); the engine drives it at
scripted depths such as 0, 0, 3, 0, 2.

Legend: B rows, T block length, D feature size, K draft depth.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _tiny import save_tiny_checkpoint

import specdec
from specdec.drafters.eagle import EagleCache, EagleConfig, EagleDrafter, EagleHead, save_eagle_head
from specdec.drafters.eagle.queue import FeatureQueue
from specdec.drafters.ngram_eagle import NGramEagleDrafter
from specdec.engine import Engine
from specdec.engine.depth import DepthPolicy, RowView
from specdec.protocols import DecodeState, DraftCall, TargetOutput
from specdec.sampling import SamplingParams
from specdec.targets.llama import LlamaTarget

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8] * 3, [20, 21, 22] * 6, [9, 40, 17, 3, 250, 8]]
N = 30  # new tokens per request
SCRIPT = (0, 0, 3, 0, 2, 0, 0, 0, 0, 0, 0, 1, 4, 0, 2)  # a run of 6 zeros: past max_queued=4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Any]:
    """A tiny Llama target and two untrained head files for it: ``weights`` (EAGLE-1 input) and
    ``weights3`` (EAGLE-3 input: layer 0's output fused in, and the previous token, as the shipped
    head has)."""
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("lazy") / "tiny", seed=3)
    target = LlamaTarget.from_pretrained(path)
    parts = target.parts()
    target.reset(1, 32)
    out = target.forward(torch.tensor([list(range(3, 27))]), torch.zeros(1, dtype=torch.long))
    scales = {
        "feature_scale": 1 / float(out.hidden_BTD.std()),
        "embed_scale": 1 / float(parts.embed_VD.std()),
    }
    files = {}
    for key, more in (("weights", {}), ("weights3", {"aux_layers": (0,), "aux_scales": (1.0,)})):
        extra = {"prev_token_input": True} if more else {}
        config = EagleConfig.from_hf_config(target.config, draft_vocab_size=200, **scales, **more, **extra)
        torch.manual_seed(0)
        head = EagleHead(config)
        if head.fc_aux is not None:  # mix the aux layer in (a new head starts as the EAGLE-1 input)
            torch.nn.init.normal_(head.fc_aux.weight, std=0.05)
        head.draft_vocab_N = torch.arange(200)
        head.attach(parts)
        files[key] = str(tmp_path_factory.mktemp("head") / "head.safetensors")
        save_eagle_head(head, files[key], target_name="tiny", embed_VD=parts.embed_VD)
    plain = {
        i: specdec.generate(
            target, [p], drafter="none", max_new_tokens=N, temperature=0.0, ignore_eos=True
        ).token_ids[0]
        for i, p in enumerate(PROMPTS)
    }
    return {"target": target, **files, "plain": plain}


class Scripted(DepthPolicy):
    """Every row's depth follows ``script`` (cycled), one entry per engine step."""

    def __init__(self, script: tuple[int, ...] = SCRIPT) -> None:
        self.script, self.gamma, self.calls = script, max(script), 0

    def depths(self, rows: list[RowView], cost: Any, t_draft: float) -> list[int]:
        K = self.script[self.calls % len(self.script)]
        self.calls += 1
        return [min(K, r.cap) for r in rows]


class Recording:
    """Wraps a slot drafter serving one request at a time: logs its proposals, after every ``observe``
    how many tokens wait, and how many drafting steps came first in their request."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.proposals, self.waiting = inner, [], []
        self.num_slots, self.first_drafts, self.fresh = inner.num_slots, 0, False

    def add(self, slot: int, prompt_ids: Any, prefill_out: TargetOutput) -> None:
        self.inner.add(slot, prompt_ids, prefill_out)
        self.fresh = True

    def drop(self, slot: int) -> None:
        self.inner.drop(slot)

    def observe(self, slots: Any, num_accepted: Any, out: TargetOutput, *, state: DecodeState) -> None:
        self.inner.observe(slots, num_accepted, out, state=state)
        eagle = self.inner.eagle if isinstance(self.inner, NGramEagleDrafter) else self.inner
        self.waiting.append(max(eagle.queue.counts[s] for s in slots))
        self.fresh = False

    def propose(self, call: DraftCall):
        p = self.inner.propose(call)
        probs = None if p.probs_TV is None else p.probs_TV.clone()
        self.proposals.append((int(call.state.lengths_B[0]), call.depths[0], [p.tokens_T.tolist()], probs))
        self.first_drafts += self.fresh and call.depths[0] > 0
        return p


class HeadCalls:
    """Counts the head layer's forwards (a chain's or catch-up's block, a tree's ``EagleCache.step``)
    and the positions each one ran."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.blocks: list[int] = []
        block, step = EagleDrafter._head_block, EagleCache.step

        def head_block(drafter, rows_G, feature_GTD, *args, **kwargs):
            self.blocks.append(feature_GTD.shape[1])
            return block(drafter, rows_G, feature_GTD, *args, **kwargs)

        def tree_step(cache, head, feature_BTD, *args, **kwargs):
            self.blocks.append(feature_BTD.shape[1])
            return step(cache, head, feature_BTD, *args, **kwargs)

        monkeypatch.setattr(EagleDrafter, "_head_block", head_block)
        monkeypatch.setattr(EagleCache, "step", tree_step)


def build(tiny: dict[str, Any], name: str, head: str = "weights", **options: Any) -> Any:
    """The drafter ``name`` on a tiny head, stop rules off (the untrained head is never sure)."""
    target, weights = tiny["target"], tiny[head]
    if name == "eagle":
        return EagleDrafter(target, num_slots=2, weights=weights, **options)
    mode = {"ngram-eagle": "chain", "ngram-eagle-auto": "auto"}[name]
    return NGramEagleDrafter(
        target,
        num_slots=2,
        mode=mode,
        weights=weights,
        min_prob=0.0,
        tree_min_prob=0.0,
        min_ngram=2,
        **options,
    )


def run(tiny: dict[str, Any], drafter: Any, settings: dict[str, Any], prompts=PROMPTS, script=SCRIPT):
    """Each prompt through an engine at the scripted depths, one request at a time (the one drafter
    object serves each in turn); returns the outputs' token ids and the recording."""
    recording = Recording(drafter)
    engine = Engine(
        tiny["target"],
        drafter=recording,
        gamma=Scripted(script),
        max_num_seqs=2,
        max_model_len=128,
        measure_cost=False,
    )
    tokens = []
    for prompt in prompts:
        rid = engine.add_request(prompt, max_new_tokens=N, ignore_eos=True, **settings)
        done = None
        while engine.has_unfinished():
            done = next((o for o in engine.step() if o.request_id == rid and o.finished), done)
        tokens.append(done.token_ids)
    return tokens, recording


GREEDY = {"temperature": 0.0}


@pytest.mark.parametrize(
    "name, head",
    [
        ("eagle", "weights"),
        ("eagle", "weights3"),
        ("ngram-eagle", "weights3"),
        ("ngram-eagle-auto", "weights3"),
    ],
)
def test_lazy_catch_up_drafts_what_an_eager_head_drafts(tiny, name, head, monkeypatch):
    """At depths 0, 0, 3, 0, 2, …: the same drafts as catching up at every step (``max_queued=0``),
    greedy output equal to plain decoding, and no head layer at a step without a head draft."""
    calls = HeadCalls(monkeypatch)
    eager_tokens, eager = run(tiny, build(tiny, name, head, max_queued=0), GREEDY)
    eager_blocks = list(calls.blocks)
    calls.blocks.clear()
    lazy_tokens, lazy = run(tiny, build(tiny, name, head), GREEDY)
    for i in range(len(PROMPTS)):
        assert lazy_tokens[i] == eager_tokens[i] == tiny["plain"][i], f"prompt {i}"
    assert [p[:3] for p in lazy.proposals] == [p[:3] for p in eager.proposals]
    assert any(len(p[2][0]) > 0 for p in lazy.proposals)  # the head did draft
    # Eager: a catch-up after every verified step; lazy: one per head draft (and none in between).
    assert len(calls.blocks) < len(eager_blocks)
    assert sum(1 for w in lazy.waiting if w > 1) > 0  # several steps' tokens waited together
    if name == "eagle":  # every K > 0 proposal is the head's: one catch-up and K - 1 chain steps each
        assert len(calls.blocks) == sum(K for _, K, _, _ in lazy.proposals)
        # eager: every observe catches up, and so does a request's first draft (its prompt waits)
        assert len(eager_blocks) == eager.first_drafts + len(eager.waiting) + sum(
            K - 1 for _, K, _, _ in eager.proposals if K > 0
        )


def test_queue_is_bounded_and_catches_up_past_it(tiny, monkeypatch):
    """With ``max_queued=4`` and long runs of depth 0, no more than 4 tokens wait after any
    ``observe``; the head then drafts what an eager head drafts."""
    script = (0,) * 9 + (2,)
    eager_tokens, eager = run(tiny, build(tiny, "eagle", max_queued=0), GREEDY, script=script)
    calls = HeadCalls(monkeypatch)
    tokens, lazy = run(tiny, build(tiny, "eagle", max_queued=4), GREEDY, script=script)
    assert tokens == eager_tokens == [tiny["plain"][i] for i in range(len(PROMPTS))]
    assert max(lazy.waiting) <= 4 and max(lazy.waiting) >= 3
    assert [p[:3] for p in lazy.proposals] == [p[:3] for p in eager.proposals]
    assert any(T > 1 for T in calls.blocks)  # caught up several tokens in one head forward
    unbounded_tokens, unbounded = run(tiny, build(tiny, "eagle", max_queued=100), GREEDY, script=script)
    assert unbounded_tokens == tokens and max(unbounded.waiting) > 4


@pytest.mark.parametrize("name", ["eagle", "ngram-eagle"])
def test_seeded_sampled_requests_repeat_and_match_the_eager_head(tiny, name):
    """A sampled request with a seed gives the same tokens run after run, and the same as with a
    head that catches up at every step (its draft distributions equal to float rounding)."""
    settings = {"temperature": 0.8, "top_k": 20, "seed": 7}
    first, rec = run(tiny, build(tiny, name, "weights3"), settings)
    again, _ = run(tiny, build(tiny, name, "weights3"), settings)
    eager, rec_eager = run(tiny, build(tiny, name, "weights3", max_queued=0), settings)
    assert first == again
    assert first == eager
    assert [p[:3] for p in rec.proposals] == [p[:3] for p in rec_eager.proposals]
    for (_, _, _, probs), (_, _, _, probs_eager) in zip(rec.proposals, rec_eager.proposals, strict=True):
        if probs is not None:
            torch.testing.assert_close(probs, probs_eager, rtol=1e-5, atol=1e-6)
    assert len({tuple(t) for t in first}) == len(PROMPTS)


def test_feature_queue_holds_ragged_rows_in_order_and_grows():
    queue = FeatureQueue(2, 3, "cpu", capacity=2)
    block_BTD = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)
    queue.push(block_BTD, [1, 3])
    queue.push(block_BTD + 100, [2, 0])
    assert queue.longest == 3 and queue.counts == [3, 3]
    feat_BTD, count_B = queue.take()
    assert count_B.tolist() == [3, 3] and queue.longest == 0
    torch.testing.assert_close(feat_BTD[0], torch.cat([block_BTD[0, :1], block_BTD[0, :2] + 100]))
    torch.testing.assert_close(feat_BTD[1], block_BTD[1, :3])
    queue.push(block_BTD, [0, 2])
    assert queue.counts == [0, 2]
    torch.testing.assert_close(queue.take()[0][1], block_BTD[1, :2])


def test_bad_max_queued_and_observe_before_add_raise(tiny):
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="max_queued"):
            EagleDrafter(tiny["target"], weights=tiny["weights"], max_queued=bad)
        with pytest.raises(ValueError, match="max_queued"):
            NGramEagleDrafter(tiny["target"], weights=tiny["weights"], max_queued=bad)
    drafter = EagleDrafter(tiny["target"], weights=tiny["weights"])
    state = DecodeState(
        tokens_BL=torch.zeros(1, 8, dtype=torch.long),
        prompt_lengths_B=torch.tensor([3]),
        lengths_B=torch.tensor([4]),
        finished_B=torch.zeros(1, dtype=torch.bool),
    )
    out = TargetOutput(logits_BTV=torch.zeros(1, 1, 259), hidden_BTD=torch.zeros(1, 1, 64))
    with pytest.raises(ValueError, match="hold no request"):
        drafter.observe([0], [0], out, state=state)
    with pytest.raises(ValueError, match="hold no request"):
        drafter.propose(DraftCall([0], [2], state, [SamplingParams()]))
