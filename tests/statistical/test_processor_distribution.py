"""Speculative decoding keeps the *processed* target distribution exactly under logits processors:
penalties, ``logit_bias``, ``min_tokens``, a plugin's own processor, alone and with temperature /
top-k / top-p / min-p (:mod:`specdec.logits`).

A processor is a function of the tokens before a position, so a draft position's target distribution
depends on the drafts before it. These checks fail when a verify position is processed with any
prefix but its own:

1. Exact enumeration (:func:`specdec.testing.expected_output_distribution`, every draft sequence and
   verify path through the real rule, the target processed with each position's own output) equals the
   processed target's joint (:func:`specdec.testing.target_sequence_distribution`) to 1e-12, and is far
   from the unprocessed joint (the processors matter on these models).
2. Monte-Carlo through the real engine (:func:`specdec.generate`, where the processors run), chains
   with a sampled toy drafter and token trees with a toy tree drafter, G-test at false-alarm rate
   ALPHA = 1e-6 per check (tests/_stat_checks.py), sized for a bias of total variation 0.03.
3. A planted bug: every verify position processed with the committed output only (the draft path
   ignored: what a server that processes once per step does) is caught at the same sample size.
"""

from __future__ import annotations

import pytest
from _stat_checks import ALPHA, Design
from _tree_toys import TreeMarkovDrafter, TreeMarkovTarget

import specdec.engine.processing
from specdec.sampling import SamplingParams
from specdec.testing import (
    MarkovModel,
    assert_same_distribution,
    expected_output_distribution,
    goodness_of_fit,
    sample_output_distribution,
    target_sequence_distribution,
    total_variation,
)
from specdec.verify.token_tree import TokenTree

pytestmark = pytest.mark.statistical

DESIGN = Design(tv=0.03)
EOS = 3
PROMPT = (1, 2)
NUM_TOKENS = 3
TARGET = MarkovModel.random(4, order=2, seed=51, eos_token_ids=(EOS,))
DRAFTER = MarkovModel.random(4, order=1, seed=52)


def no_repeat(prompt_ids, output_ids, logits_V):
    """A plugin's processor: the last generated token may not come again at once."""
    if output_ids:
        logits_V = logits_V.clone()
        logits_V[output_ids[-1]] = float("-inf")
    return logits_V


CASES = {
    "penalties": (SamplingParams(presence_penalty=0.9, frequency_penalty=0.6, repetition_penalty=1.8), ()),
    "bias+min_tokens": (SamplingParams(logit_bias={0: 1.5, 2: -100}, min_tokens=2), ()),
    "all+filters": (
        SamplingParams(
            temperature=0.8,
            top_k=3,
            top_p=0.95,
            min_p=0.05,
            presence_penalty=0.8,
            repetition_penalty=1.5,
            logit_bias={1: -1.0},
            min_tokens=1,
        ),
        (),
    ),  # fmt: skip
    "plugin": (SamplingParams(temperature=1.2), (no_repeat,)),
}


def _expected(sampling: SamplingParams, processors=()) -> dict:
    return target_sequence_distribution(
        TARGET,
        num_tokens=NUM_TOKENS,
        context=PROMPT,
        sampling=sampling,
        eos_token_ids=(EOS,),
        logits_processors=processors,
    )


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("draft", ["sample", "point_mass"])
def test_exact_enumeration_keeps_the_processed_target(case, draft):
    sampling, processors = CASES[case]
    law = expected_output_distribution(
        TARGET,
        DRAFTER,
        gamma=2,
        context=PROMPT,
        num_tokens=NUM_TOKENS,
        draft=draft,
        sampling=sampling,
        eos_token_ids=(EOS,),
        logits_processors=processors,
    )
    expected = _expected(sampling, processors)
    assert total_variation(law, expected) < 1e-12
    plain = SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    assert total_variation(expected, _expected(plain)) > 0.05  # the processors change the target


def _chain_counts(sampling, processors, seed: int, N: int):
    return sample_output_distribution(
        TARGET,
        DRAFTER,
        gamma=2,
        context=PROMPT,
        num_tokens=NUM_TOKENS,
        sampling=sampling,
        eos_token_ids=(EOS,),
        num_samples=N,
        via="generate",
        seed=seed,
        logits_processors=processors,
    )


@pytest.mark.slow  # 4-7 s a case on 2 cores
@pytest.mark.parametrize("case", list(CASES))
def test_engine_chains_keep_the_processed_target(case):
    sampling, processors = CASES[case]
    expected = _expected(sampling, processors)
    counts = _chain_counts(sampling, processors, seed=21, N=DESIGN.sample_size(expected))
    assert DESIGN.check(counts, expected, f"engine chains, {case}").passed


TREE = TokenTree.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)])
TREE_SAMPLES = 60_000


@pytest.mark.slow  # about 6 s on 2 cores
def test_engine_trees_keep_the_processed_target():
    """Each tree node is processed with the drafts on its own path from the root."""
    target = MarkovModel.random(4, order=2, seed=1)
    draft = MarkovModel.random(4, order=2, seed=101, scale=3.0)
    sampling = SamplingParams(
        temperature=0.9, presence_penalty=1.0, repetition_penalty=1.6, logit_bias={2: 0.8}
    )
    context = (1, 0)
    expected = target_sequence_distribution(target, num_tokens=4, context=context, sampling=sampling)
    counts = sample_output_distribution(
        TreeMarkovTarget(target),
        TreeMarkovDrafter(draft, TREE, mode="without"),
        num_samples=TREE_SAMPLES,
        gamma=TREE.max_depth,
        context=context,
        num_tokens=4,
        sampling=sampling,
        via="generate",
        seed=9,
        batch_size=TREE_SAMPLES,
    )
    assert_same_distribution(counts, expected, alpha=ALPHA, label="trees with processors")


@pytest.mark.slow  # about 6 s on 2 cores
def test_a_position_processed_without_its_draft_path_is_caught(monkeypatch):
    """Planted bug: every position of a block sees the committed output alone."""

    def committed_only(unit, i):
        return [[] for _ in range(unit.block.num_drafted + 1)]

    monkeypatch.setattr(specdec.engine.processing, "block_paths", committed_only)
    sampling, processors = CASES["penalties"]
    expected = _expected(sampling, processors)
    counts = _chain_counts(sampling, processors, seed=22, N=DESIGN.sample_size(expected))
    result = goodness_of_fit(counts, expected, alpha=ALPHA)
    assert not result.passed, f"the planted bug was not detected: {result}"
