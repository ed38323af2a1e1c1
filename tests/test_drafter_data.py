"""The EAGLE head's training data: held-out split, function prompts and the target's continuations."""

from __future__ import annotations

import textwrap

import pytest
from _tiny import byte_tokenizer, save_tiny_checkpoint

import specdec
from experiments import drafter_data
from experiments.drafter_data import Prompt, function_prompts, generate_continuations, is_heldout
from specdec.targets.llama import LlamaTarget


def test_heldout_split_is_exactly_what_bench_picks():
    for source, size in drafter_data.SET_SIZES.items():
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
    monkeypatch.setattr(drafter_data, "_text_files", lambda seed: [path])
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
