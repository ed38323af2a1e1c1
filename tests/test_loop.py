"""The decode loop (specdec.generate): exactness, batching, stop conditions, seeds, streaming.

Greedy output is compared with ``transformers``' own greedy ``generate``, token for token, on a tiny
random Llama (always) and on the real SmolLM2-135M (``-m model``). The sampling distribution is
checked against exact probabilities of a trigram-table target with chi-square tests.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from _tiny import TableTarget, byte_tokenizer, random_table, tiny_llama

import specdec
from specdec.drafters.model import ModelDrafter
from specdec.targets.hf import HFTarget

PROMPTS = ["def add(a, b):\n    return", "hello hello hello world", "x = [1, 2, 3]\ny = [", "The sky is"]


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def tiny(tok):
    model = tiny_llama(seed=1)
    return model, HFTarget(model, tok)


@pytest.fixture(scope="module")
def tiny_draft(tok):
    return HFTarget(tiny_llama(seed=2), tok)


def hf_greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    x = torch.tensor([ids])
    with torch.inference_mode():
        y = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=258,
        )
    return y[0, len(ids) :].tolist()


# --- greedy exactness --------------------------------------------------------------------------------


@pytest.mark.parametrize("drafter", ["none", "ngram", "model"])
def test_greedy_equals_transformers_generate(tiny, tiny_draft, tok, drafter):
    model, target = tiny
    for text in PROMPTS[:2]:
        ids = tok(text).input_ids
        ref = hf_greedy(model, ids, 24)
        d = ModelDrafter(target, num_slots=8, model=tiny_draft) if drafter == "model" else drafter
        out = specdec.generate(target, [ids], drafter=d, temperature=0.0, max_new_tokens=24, gamma=3)
        assert out.token_ids[0] == ref, (drafter, text)
        assert out.finish_reasons[0] == ("eos" if ref[-1] == 258 else "length")


def test_greedy_model_drafter_with_itself_accepts_everything(tiny, tok):
    """A draft model identical to the target is always right: α = 1, τ = γ + 1 (the draft cache
    bookkeeping, including the catch-up after a fully accepted step, is exact)."""
    _, target = tiny
    ids = tok(PROMPTS[0]).input_ids
    draft = HFTarget(tiny_llama(seed=1), tok)
    kw = dict(temperature=0.0, max_new_tokens=31, gamma=4, ignore_eos=True)
    out = specdec.generate(target, [ids], drafter=ModelDrafter(target, num_slots=8, model=draft), **kw)
    assert out.token_ids == specdec.generate(target, [ids], drafter="none", **kw).token_ids
    m = out.metrics
    assert m.acceptance_rate == 1.0
    assert m.mean_accepted_tokens == 5.0
    assert m.num_steps == 6  # 30 tokens after the first one, 5 per step
    assert m.acceptance_histogram == [1.0] * 4


def test_gamma_zero_and_empty_proposals_are_plain_steps(tiny, tok):
    model, target = tiny
    ids = tok(PROMPTS[1]).input_ids
    out = specdec.generate(target, [ids], drafter="ngram", gamma=0, temperature=0.0, max_new_tokens=16)
    assert out.token_ids[0] == hf_greedy(model, ids, 16)
    assert out.metrics.num_proposed == 0
    assert out.metrics.mean_accepted_tokens == 1.0
    assert out.metrics.num_target_calls == 1 + out.metrics.num_steps
    assert set(out.metrics.gamma_history) == {0}


def test_stop_strings(tiny, tok):
    model, target = tiny
    ids = tok(PROMPTS[3]).input_ids
    ref = hf_greedy(model, ids, 30)
    stop = _printable_run(tok, ref, 8)
    out = specdec.generate(
        target, [ids], drafter="ngram", temperature=0.0, max_new_tokens=30, stop_strings=[stop], tokenizer=tok
    )
    got = out.token_ids[0]
    assert out.finish_reasons == ["stop_string"]
    assert got == ref[: len(got)]
    assert stop in tok.decode(got) and stop not in tok.decode(got[:-1])
    # The target's own tokenizer is used when none is passed.
    out2 = specdec.generate(
        target, [ids], drafter="none", temperature=0.0, max_new_tokens=30, stop_strings=[stop]
    )
    assert out2.token_ids == out.token_ids


def _printable_run(tok, ids: list[int], start: int) -> str:
    """The text of the first two consecutive plain-ASCII tokens at or after ``start``."""
    for i in range(start, len(ids) - 1):
        pieces = [tok.decode([t]) for t in ids[i : i + 2]]
        if all(len(p) == 1 and p.isascii() and p.isprintable() for p in pieces):
            return "".join(pieces)
    raise AssertionError("no printable pair of tokens in the reference output")


# --- the loop on a fast toy target (trigram table) --------------------------------------------------------

V_TOY = 9
EOS_TOY = 8


@pytest.fixture(scope="module")
def toy():
    return TableTarget(random_table(V_TOY, seed=0, scale=2.0), eos_token_ids=(EOS_TOY,))


def toy_drafter(toy, kind: str, noise: float = 1.0):
    """``none`` / ``ngram`` / ``model`` (a noisy copy of the target's table: partial acceptance)."""
    if kind != "model":
        return kind
    g = torch.Generator().manual_seed(5)
    table = toy.table_VVV + noise * torch.randn(toy.table_VVV.shape, generator=g)
    return ModelDrafter(toy, num_slots=8, model=TableTarget(table))


def toy_greedy(toy, prompt: list[int], n: int, eos=(EOS_TOY,)) -> list[int]:
    seq = list(prompt)
    out = []
    for _ in range(n):
        t = int(toy.next_probs(seq, temperature=0.0).argmax())
        out.append(t)
        seq.append(t)
        if t in eos:
            break
    return out


TOY_PROMPTS = [[1, 2, 3, 1, 2], [4], [5, 6, 5, 6, 5, 6, 7], [3, 3]]


@pytest.mark.parametrize("drafter", ["none", "ngram", "model"])
@pytest.mark.parametrize("gamma", [1, 4, "batch-table", "goodput"])
def test_toy_greedy_batch_equals_reference(toy, drafter, gamma):
    out = specdec.generate(
        toy, TOY_PROMPTS, drafter=toy_drafter(toy, drafter), gamma=gamma, temperature=0.0, max_new_tokens=40
    )
    for b, p in enumerate(TOY_PROMPTS):
        ref = toy_greedy(toy, p, 40)
        assert out.token_ids[b] == ref, b
        assert out.finish_reasons[b] == ("eos" if ref[-1] == EOS_TOY else "length")


def test_batch_ragged_acceptance(toy):
    commits: dict[int, list[list[int]]] = {b: [] for b in range(len(TOY_PROMPTS))}
    out = specdec.generate(
        toy,
        TOY_PROMPTS,
        drafter=toy_drafter(toy, "model", noise=1.5),
        temperature=0.0,
        max_new_tokens=40,
        gamma=3,
        ignore_eos=True,
        on_commit=lambda b, ids: commits[b].append(ids),
    )
    for b in commits:
        assert sum(commits[b], []) == out.token_ids[b]
        assert len(out.token_ids[b]) == 40
    # Ragged acceptance actually happened: in some step rows committed different numbers of tokens.
    assert any(len({len(commits[b][s]) for b in commits}) > 1 for s in range(1, 10))
    assert 0 < out.metrics.acceptance_rate < 1
    assert out.prompt_token_ids == TOY_PROMPTS


def test_finished_rows_stay_out_of_the_way(toy):
    """Rows that finish early (EOS) stay in the batch without disturbing the others."""
    refs = [toy_greedy(toy, p, 30, eos=()) for p in TOY_PROMPTS]
    stop = refs[0][3]
    out = specdec.generate(
        toy, TOY_PROMPTS, drafter="ngram", temperature=0.0, max_new_tokens=30, eos_token_ids=[stop], gamma=3
    )
    for b, ref in enumerate(refs):
        cut = ref.index(stop) + 1 if stop in ref else len(ref)
        assert out.token_ids[b] == ref[:cut]
        assert out.finish_reasons[b] == ("eos" if stop in ref else "length")
    assert out.finish_reasons[0] == "eos"


def test_tensor_prompts(toy):
    out = specdec.generate(toy, torch.tensor([[1, 2, 3], [1, 2, 3]]), drafter="ngram", temperature=0.0)
    assert out.token_ids[0] == out.token_ids[1] == toy_greedy(toy, [1, 2, 3], 128)
    import numpy as np

    rows = [np.array([1, 2, 3]), torch.tensor([1, 2, 3]), (1, 2, 3)]
    assert specdec.generate(toy, rows, drafter="none", temperature=0.0).token_ids == [out.token_ids[0]] * 3


@pytest.mark.parametrize("drafter", ["none", "ngram", "model"])
def test_max_new_tokens_is_never_exceeded(toy, drafter):
    for n in (1, 2, 5, 17):
        out = specdec.generate(
            toy,
            TOY_PROMPTS,
            drafter=toy_drafter(toy, drafter),
            gamma=8,
            temperature=1.0,
            seed=n,
            max_new_tokens=n,
            ignore_eos=True,
        )
        assert [len(r) for r in out.token_ids] == [n] * len(TOY_PROMPTS)
        assert out.finish_reasons == ["length"] * len(TOY_PROMPTS)
        assert out.metrics.num_generated_tokens == n * len(TOY_PROMPTS)


def test_eos_and_ignore_eos(toy):
    prompt = TOY_PROMPTS[2]
    ref = toy_greedy(toy, prompt, 30, eos=())
    eos = ref[6]
    out = specdec.generate(
        toy, [prompt], drafter="ngram", temperature=0.0, max_new_tokens=30, eos_token_ids=[eos]
    )
    assert out.token_ids[0] == ref[: ref.index(eos) + 1]
    assert out.finish_reasons == ["eos"]
    out = specdec.generate(
        toy, [prompt], drafter="ngram", temperature=0.0, max_new_tokens=30, ignore_eos=True
    )
    assert out.token_ids[0] == ref and out.finish_reasons == ["length"]


# --- seeds and sampling --------------------------------------------------------------------------------


@pytest.mark.parametrize("drafter", ["none", "ngram", "model"])
def test_same_seed_same_tokens(toy, drafter):
    def run(seed):
        return specdec.generate(
            toy,
            TOY_PROMPTS,
            drafter=toy_drafter(toy, drafter),
            temperature=1.0,
            top_k=6,
            max_new_tokens=30,
            seed=seed,
            ignore_eos=True,
        ).token_ids

    a, b, c = run(7), run(7), run(8)
    assert a == b
    assert a != c
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    kw = dict(drafter=toy_drafter(toy, drafter), temperature=0.8, max_new_tokens=20)
    assert (
        specdec.generate(toy, TOY_PROMPTS, generator=g1, **kw).token_ids
        == specdec.generate(toy, TOY_PROMPTS, generator=g2, **kw).token_ids
    )


def _exact_joint(target: TableTarget, prompt: list[int], n: int, **sampling) -> dict[tuple[int, ...], float]:
    """P(first n generated tokens) by enumeration."""
    V = target.vocab_size
    out = {}
    for seq in itertools.product(range(V), repeat=n):
        p, prefix = 1.0, list(prompt)
        for t in seq:
            p *= float(target.next_probs(prefix, **sampling)[t])
            prefix.append(t)
        out[seq] = p
    return out


@pytest.mark.slow  # 4-19 s a case on 2 cores
@pytest.mark.statistical
@pytest.mark.parametrize(
    "drafter,sampling",
    [
        ("model", {"temperature": 1.0}),
        ("model", {"temperature": 0.7, "top_k": 4, "top_p": 0.9}),
        ("ngram", {"temperature": 1.0}),
        ("model-stop", {"temperature": 1.0}),
        ("model-stop", {"temperature": 0.7, "top_k": 4, "top_p": 0.9}),
    ],
)
def test_sampling_distribution_is_exact(drafter, sampling):
    """Joint law of the first 3 (4 with the confidence stop) generated tokens = the target's, through
    ragged batched speculation.

    G-test on the 5^n joint cells through ``specdec.testing`` (small cells pooled, impossible cells must
    stay empty) at a false-alarm rate of 1e-6, the per-check budget of the statistical suite (see
    tests/statistical/test_verify_distribution.py for the suite-wide arithmetic).
    """
    from specdec.testing import assert_same_distribution

    V, N, n = 5, 20000, 3
    target = TableTarget(random_table(V, seed=0))
    prompt = [1, 2, 1, 2]  # repetitive, so the n-gram drafter proposes
    cut = []  # (γ asked, drafts proposed) per step

    class Recording(ModelDrafter):
        def propose(self, call):
            p = super().propose(call)
            cut.extend((k, n) for k, n in zip(call.depths, p.counts_B, strict=True) if k > 0)
            return p

    d = drafter
    if drafter == "model":
        d = Recording(target, num_slots=N, model=TableTarget(random_table(V, seed=1)), capacity=16)
    elif drafter == "model-stop":
        # Confidence stop at 0.4 with γ = 2, built so the stop cuts chains after one token. The
        # target's first token is 3 (a +20 logit after the prompt), so every row drafts from the
        # same context (2, 3) first; there the draft model is sure of one token (q ≈ 0.83 at T = 1):
        # a row that drew it is still above 0.4 and drafts a second token (K = γ), a row that drew
        # another (q < 0.4) is below and stops after it (K = 1 < γ). A sampled stop decides before
        # a token is drawn (specdec.drafters.confidence: exactness). One more token keeps three
        # random ones.
        n = 4
        table = random_table(V, seed=0)
        table[1, 2] = 0.0
        table[1, 2, 3] = 20.0
        target = TableTarget(table)
        draft = random_table(V, seed=1, scale=4.0)
        draft[2, 3] = 0.0
        draft[2, 3, int(table[2, 3].argmax())] = 3.0  # a token the target keeps under top-k / top-p
        draft[3] = 0.0
        d = Recording(target, num_slots=N, model=TableTarget(draft), min_prob=0.4, capacity=16)
    out = specdec.generate(target, [prompt] * N, drafter=d, max_new_tokens=n, gamma=2, seed=123, **sampling)
    assert out.metrics.num_proposed > 0 and 0 < out.metrics.acceptance_rate < 1
    if drafter == "model-stop":  # drafts ran to γ; at T = 1 the stop cut chains after one token
        assert any(k == g > 0 for g, k in cut)
        # (at T = 0.7, top-k 4, top-p 0.9 the sure token is the draft's only one: nothing to cut)
        assert ((2, 1) in cut) == (sampling == {"temperature": 1.0})
    exact = _exact_joint(target, prompt, n, **sampling)
    counts: dict[tuple[int, ...], int] = {}
    for row in out.token_ids:
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    report = assert_same_distribution(counts, exact, alpha=1e-6, label=f"generate/{drafter}")
    print(f"generate/{drafter} {sampling}: p-value {report.p_value:.3g}")


def test_table_target_cache_protocol_holds_across_drafters():
    """The strict toy target rejects any block that skips a token or reads past a rollback."""
    target = TableTarget(random_table(7, seed=3), eos_token_ids=(6,))
    prompts = [[1, 2, 3], [4], [1, 2, 3, 4, 5, 1, 2]]
    for drafter in [
        "none",
        "ngram",
        ModelDrafter(target, num_slots=8, model=TableTarget(random_table(7, seed=4))),
    ]:
        for policy in [3, "batch-table", "goodput"]:
            out = specdec.generate(
                target, prompts, drafter=drafter, gamma=policy, temperature=0.9, seed=0, max_new_tokens=30
            )
            for b, row in enumerate(out.token_ids):
                assert 1 <= len(row) <= 30
                assert (row[-1] == 6) == (out.finish_reasons[b] == "eos")
                assert 6 not in row[:-1]


# --- validation ----------------------------------------------------------------------------------------


def test_bad_input_raises_value_error(tiny, tok):
    _, target = tiny
    ids = tok("hi").input_ids
    with pytest.raises(ValueError, match="prompt_ids"):
        specdec.generate(target, [[]])
    with pytest.raises(ValueError, match="prompt_ids"):
        specdec.generate(target, [[1, 100000]])
    with pytest.raises(ValueError, match="prompt_ids"):
        specdec.generate(target, "hello")
    with pytest.raises(ValueError, match="max_new_tokens"):
        specdec.generate(target, [ids], max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        specdec.generate(target, [ids], temperature=-1.0)
    with pytest.raises(ValueError, match="known drafters: .*ngram"):
        specdec.generate(target, [ids], drafter="no-such-drafter")
    with pytest.raises(ValueError, match="gamma"):
        specdec.generate(target, [ids], gamma=-1)
    with pytest.raises(ValueError, match="stop_strings"):
        specdec.generate(TableTarget(random_table(5, seed=0)), [[1]], stop_strings=["x"])
    with pytest.raises(ValueError, match="seed"):
        specdec.generate(target, [ids], seed=1, generator=torch.Generator())
    with pytest.raises(ValueError, match="target"):
        specdec.generate(object(), [ids])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_drafter_proposing_unknown_token_ids_is_a_value_error(tiny, tok, temperature):
    from specdec.protocols import Proposal

    _, target = tiny

    class OutOfVocab:
        def begin(self, state, prefill_out):
            pass

        def propose(self, state, gamma, generator=None):
            return Proposal(torch.full((state.batch_size, gamma), target.vocab_size), None)

        def observe(self, state, num_accepted_B, verify_out):
            pass

    # Seeded, EOS ignored: an unseeded sampled run could draw EOS as its first token and end before step 1.
    with pytest.raises(ValueError, match=r"step 1: drafter OutOfVocab: tokens_BK must hold token ids in \["):
        specdec.generate(
            target,
            [tok("hi").input_ids],
            drafter=OutOfVocab(),
            temperature=temperature,
            seed=0,
            ignore_eos=True,
        )


# --- metrics from a run --------------------------------------------------------------------------------


def test_run_metrics_are_consistent(toy):
    out = specdec.generate(toy, TOY_PROMPTS, drafter="ngram", gamma=3, temperature=0.0, max_new_tokens=30)
    m = out.metrics
    assert m.num_generated_tokens == sum(len(r) for r in out.token_ids)
    assert m.mean_accepted_tokens == pytest.approx((m.num_accepted + m.num_row_steps) / m.num_row_steps)
    assert m.acceptance_rate == pytest.approx(m.num_accepted / m.num_proposed)
    assert m.num_target_calls == m.num_steps + 1
    assert len(m.gamma_history) == m.num_steps
    assert 0 < m.ttft_s <= m.total_time_s
    assert m.latency_p50_s <= m.latency_p99_s
    assert m.target_time_s + m.draft_time_s <= m.total_time_s
    assert len(m.acceptance_histogram) == max(m.draft_len_history)
    assert sum(m.verify_count_by_block.values()) == m.num_steps
    d = m.to_dict()
    for key in ("acceptance_rate", "mean_accepted_tokens", "tokens_per_second", "ttft_s", "tpot_s"):
        assert key in d


# --- the real model ------------------------------------------------------------------------------------

SMOL_TOKENS = 32
SMOL_EOS_PROMPT = "<|im_start|>user\nList three fruits.<|im_end|>\n<|im_start|>assistant\n"
"""A chat turn whose greedy answer ends (EOS) within SMOL_TOKENS: stopping is compared too."""


@pytest.fixture(scope="module")
def smollm(smollm2_greedy):
    """(tokenizer, our target in the format equal to transformers (``gguf``), prompts, transformers'
    greedy outputs)."""
    ref = smollm2_greedy
    prompts = ref.prompts()[:2] + [ref.tokenizer(SMOL_EOS_PROMPT).input_ids]
    refs = [ref(ids, SMOL_TOKENS) for ids in prompts]
    assert ref.eos in refs[-1], "the chat prompt must reach EOS"
    return ref.tokenizer, specdec.load_target("smollm2-135m", weights="gguf"), prompts, refs


@pytest.mark.model
@pytest.mark.parametrize("drafter", ["none", "ngram", "model", "layerskip"])
def test_smollm2_greedy_equals_transformers(smollm, drafter, tmp_path):
    tokenizer, target, prompts, refs = smollm
    if drafter not in specdec.DRAFTERS:
        pytest.skip(f"drafter {drafter!r} is not registered")
    options = {}
    if drafter == "model":
        # A different model sharing the 49152-token vocabulary: a tiny random Llama saved to disk.
        from _tiny import save_tiny_checkpoint

        save_tiny_checkpoint(
            tmp_path / "draft", tokenizer=tokenizer, vocab_size=49152, hidden_size=32, eos_token_id=2
        )
        options = {"model": str(tmp_path / "draft")}
    try:
        d = specdec.create_drafter(drafter, target, **options)
    except ModuleNotFoundError as e:
        pytest.skip(f"drafter {drafter!r} not available: {e}")
    for ids, ref in zip(prompts, refs, strict=True):
        out = specdec.generate(target, [ids], drafter=d, temperature=0.0, max_new_tokens=SMOL_TOKENS, gamma=4)
        assert out.token_ids[0] == ref, (drafter, tokenizer.decode(ids))


@pytest.mark.model
def test_smollm2_model_drafter_self_and_batch(smollm):
    """The target checkpoint as its own draft model (α = 1), on a ragged batch."""
    tokenizer, target, prompts, refs = smollm
    draft = specdec.load_target("smollm2-135m", weights="gguf")  # same weights, its own cache
    out = specdec.generate(
        target,
        prompts,
        drafter=ModelDrafter(target, num_slots=8, model=draft),
        temperature=0.0,
        max_new_tokens=24,
        gamma=3,
    )
    for b in range(len(prompts)):
        assert out.token_ids[b] == refs[b][: len(out.token_ids[b])] and len(out.token_ids[b]) == min(
            24, len(refs[b])
        )
    assert out.metrics.acceptance_rate == 1.0
