"""The EAGLE head's training data: held-out split, function prompts and the target's continuations."""

from __future__ import annotations

import textwrap

import pytest
from _tiny import byte_tokenizer, save_tiny_checkpoint

import specdec
from specdec.drafters.eagle.train import config, dataset, sources
from specdec.drafters.eagle.train.sources import Prompt, function_prompts, generate_continuations, is_heldout
from specdec.targets.llama import LlamaTarget


def test_heldout_split_is_exactly_what_bench_picks():
    for source, size in sources.SET_SIZES.items():
        picked = {(i * size) // n for n in range(1, 9) for i in range(n)}
        assert {i for i in range(size) if is_heldout(source, i)} == picked


def test_function_prompts_are_signature_and_docstring_in_three_forms(tmp_path, monkeypatch):
    source = textwrap.dedent(
        '''
        import os

        def public(a, b=2):
            """Add two numbers and return the sum of both arguments, as an integer."""
            return a + b

        def _private(x):
            """A private helper with a docstring long enough to qualify otherwise."""
            return x

        def nodoc(x):
            return x

        class C:
            def method(self):
                """Methods are skipped: only module-level functions become prompts."""
        '''
    )
    path = tmp_path / "mod.py"
    path.write_text(source)
    monkeypatch.setattr(sources, "_text_files", lambda seed: [path])
    prompts = function_prompts(byte_tokenizer(), 5, seed=0)
    tok = byte_tokenizer()
    assert [p.kind for p in prompts] == ["code", "instruct", "instruct-chat"]
    assert not any(p.heldout for p in prompts)
    code = tok.decode(prompts[0].ids)
    assert code.startswith("def public(a, b=2):") and code.rstrip().endswith('integer."""')
    assert "return a + b" not in code  # the body is what the target writes
    assert tok.decode(prompts[1].ids).startswith("Write a Python function `public`. Add two numbers")
    assert "<|im_start|>assistant" in tok.decode(prompts[2].ids)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return LlamaTarget.from_pretrained(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=3))


def test_continuations_are_the_targets_own_decodes(target):
    prompts = [Prompt(f"p{i}", "code", False, tuple(range(10 + i, 15 + 2 * i))) for i in range(3)]
    greedy = generate_continuations(
        target, prompts, max_new_tokens=12, temperature=0.0, batch_size=2, seed=0, log=lambda s: None
    )
    for p, conts in zip(prompts, greedy, strict=True):
        assert len(conts) == 1
        alone = specdec.generate(target, [list(p.ids)], drafter="none", max_new_tokens=12, temperature=0.0)
        assert conts[0] == alone.token_ids[0]

    def sample():
        return generate_continuations(
            target,
            prompts,
            max_new_tokens=12,
            temperature=1.0,
            num_samples=3,
            batch_size=4,
            seed=1,
            log=lambda s: None,
        )

    sampled = sample()
    assert [len(c) for c in sampled] == [3, 3, 3]
    eos = set(target.eos_token_ids)
    for conts in sampled:
        for c in conts:
            assert 1 <= len(c) <= 12 and not (eos & set(c[:-1]))  # cut right after an EOS, if any
    assert len({tuple(c) for conts in sampled for c in conts}) > 3  # samples differ
    again = sample()
    assert again == sampled  # seeded


@pytest.mark.slow
def test_self_instruct_requests_are_complete_distinct_user_turns(target):
    def sample(seed):
        return sources.self_instruct_requests(
            target, 12, max_tokens=400, seed=seed, batch_size=5, log=lambda s: None
        )

    requests = sample(0)
    assert requests, "a random tiny model ends some of 12 turns within 400 tokens"
    assert len(requests) <= 12 and len(set(requests)) == len(requests)
    assert all(len(r) >= 16 and r == r.strip() and "<|im_end|>" not in r for r in requests)
    assert sample(0) == requests  # seeded
    assert sample(1) != requests
    # A turn cut off by max_tokens is dropped, never kept half-written.
    assert (
        sources.self_instruct_requests(target, 6, max_tokens=1, seed=0, batch_size=6, log=lambda s: None)
        == []
    )


def test_self_instruct_prompts_are_raw_and_chat_forms():
    tok = byte_tokenizer()
    prompts = sources.self_instruct_prompts(tok, ["Plan a garden for me.", "Explain tides."])
    assert [(p.pid, p.kind, p.heldout) for p in prompts] == [
        ("self/0", "self", False),
        ("self/0/chat", "self-chat", False),
        ("self/1", "self", False),
        ("self/1/chat", "self-chat", False),
    ]
    assert tok.decode(prompts[2].ids) == "Explain tides."
    assert tok.decode(prompts[3].ids) == "<|im_start|>user\nExplain tides.<|im_end|>\n<|im_start|>assistant\n"


def test_self_instruct_needs_a_chat_template(tmp_path):
    tok = byte_tokenizer()
    tok.chat_template = None
    plain = LlamaTarget.from_pretrained(save_tiny_checkpoint(tmp_path, tokenizer=tok, seed=3))
    with pytest.raises(ValueError, match="chat template"):
        sources.self_instruct_requests(plain, 2, max_tokens=4, seed=0, batch_size=2)


def test_shard_key_addresses_content():
    chunk = [("a/greedy0", False, [1, 2, 3]), ("b", True, [4, 5])]
    key = dataset.shard_key("smollm2-135m", 8, chunk)
    assert key == dataset.shard_key("smollm2-135m", 8, [(n, h, list(t)) for n, h, t in chunk])
    assert key.startswith("smollm2-135m-")
    changed = [
        dataset.shard_key("other", 8, chunk),
        dataset.shard_key("smollm2-135m", 4, chunk),
        dataset.shard_key("smollm2-135m", 8, [chunk[0], ("b", True, [4, 6])]),
        dataset.shard_key("smollm2-135m", 8, [chunk[0], ("b", False, [4, 5])]),
        dataset.shard_key("smollm2-135m", 8, [("c/greedy0", False, [1, 2, 3]), chunk[1]]),
        dataset.shard_key("smollm2-135m", 8, chunk[::-1]),
    ]
    assert len({key, *changed}) == 7


def _natural(n: int = 12) -> list[tuple[str, bool, list[int]]]:
    tok = byte_tokenizer()
    words = "the plot was terrible and the cast could not save a story about three old friends".split()
    out = []
    for i in range(n):
        text = f"Item {i:02d}: " + " ".join(words[i % 5 :] + words[: i % 5]) + "."
        out.append((f"s/{i}", i % 4 == 3, tok(text).input_ids))
    return out


def test_repeat_sequences_write_one_new_span_again_and_again():
    tok = byte_tokenizer()
    natural = _natural()
    held_openings = [ids[:16] for _, held, ids in natural if held]
    lessons = sources.repeat_sequences(tok, natural, 20, length=400, seed=0)
    assert [n for n, _, _ in lessons] == [f"repeat/{i}" for i in range(20)]
    assert not any(held for _, held, _ in lessons)
    assert lessons == sources.repeat_sequences(tok, natural, 20, length=400, seed=0)
    assert lessons != sources.repeat_sequences(tok, natural, 20, length=400, seed=1)
    for _, _, ids in lessons:
        assert len(ids) == 400
        # A natural opening of 16-96 tokens from a training sequence, never a held-out one.
        openings = [src for _, held, src in natural if not held and ids[:16] == src[:16]]
        assert openings, tok.decode(ids)
        assert ids[:16] not in held_openings
        # Some span of 3-48 tokens right after the opening occurs again later, token for token.
        body = ids[16:]
        repeated = any(
            body[a : a + m] == body[b : b + m]
            for m in (3,)
            for a in range(len(body) - m)
            for b in range(a + m, len(body) - m)
        )
        assert repeated, tok.decode(ids)
    # Many positions are predictable by a lookup in the window (6 bytes: this tokenizer spells bytes).
    from experiments.copy_agreement import lookup_kinds

    kinds = [k for _, _, ids in lessons for k in lookup_kinds(ids, ids[2:] + [0], n=6)[:-1]]
    assert kinds.count("copy") / len(kinds) > 0.4


def test_repeat_sequences_reject_bad_arguments():
    tok = byte_tokenizer()
    with pytest.raises(ValueError, match="n must be >= 0"):
        sources.repeat_sequences(tok, _natural(), -1)
    with pytest.raises(ValueError, match="length must be >= 32"):
        sources.repeat_sequences(tok, _natural(), 2, length=8)
    with pytest.raises(ValueError, match="training sequences"):
        sources.repeat_sequences(tok, [(n, True, ids) for n, _, ids in _natural()], 2)
    assert sources.repeat_sequences(tok, [], 0) == []


def test_data_config_key_hashes_every_field():
    """The cache directory is a hash of every field: any change is a new cache; the recipe's stays put."""
    from dataclasses import fields, replace

    base = config.DataConfig()
    for f in fields(base):
        value = getattr(base, f.name)
        other = (
            (not value) if isinstance(value, bool) else (value + "x" if isinstance(value, str) else value + 1)
        )
        assert replace(base, **{f.name: other}).key() != base.key(), f.name
    assert base.key() == "ef4a7f5259"  # the shipped head's data
