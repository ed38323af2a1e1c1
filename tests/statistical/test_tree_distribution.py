"""Token-tree verification keeps the target's distribution exactly (SpecInfer, arXiv 2305.09781;
without-replacement residuals as in arXiv 2402.14160).

Two independent checks on a tiny vocabulary (V = 4, an order-2 Markov target and a different,
peaked Markov drafter, a 6-node tree of depth 2 with 3 candidates at the root):

1. Exact enumeration (``tests/_tree_toys.exact_step_law``, written independently of
   ``specdec.verify.tree``): the law of one tree step, completed with the target's own continuation,
   equals the target's joint to 1e-12, for each way of drawing children with its residual rule;
   a mismatched rule is far off (the enumeration can tell).
2. Monte-Carlo through the real engine: ``specdec.generate`` with a tree-attention toy target and a
   toy tree drafter, so the real loop, ``specdec.verify.blocks.TreeBlock``, ``tree_rejection_sample`` and the
   KV compaction all run. G-test at false-alarm rate 1e-6 per test. A planted bug (children drawn
   without replacement, verified with the i.i.d. residual) is caught at the same sample size.
"""

from __future__ import annotations

import pytest
from _stat_checks import ALPHA, BETA
from _tree_toys import TreeMarkovDrafter, TreeMarkovTarget, complete, exact_step_law, model_fn

from specdec.sampling import SamplingParams
from specdec.testing import (
    MarkovModel,
    assert_same_distribution,
    goodness_of_fit,
    required_sample_size,
    sample_output_distribution,
    target_sequence_distribution,
    total_variation,
)
from specdec.verify.token_tree import TokenTree

pytestmark = pytest.mark.statistical

V = 4
CONTEXT = (1, 0)
TREE = TokenTree.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)])
NUM_SAMPLES = 60_000
# Tokens per run: the first comes from the prefill, the next up to 3 from one tree step.
NUM_TOKENS = 4


def _models() -> tuple[MarkovModel, MarkovModel]:
    return MarkovModel.random(V, order=2, seed=1), MarkovModel.random(V, order=2, seed=101, scale=3.0)


SAMPLINGS = {
    "T=1": SamplingParams(temperature=1.0),
    "T=0.7,top_k=3,top_p=0.9": SamplingParams(temperature=0.7, top_k=3, top_p=0.9),
}
CORRECT_RULES = [("without", "without"), ("with", "with"), ("top", "point"), ("without", "point")]


@pytest.mark.parametrize("sampling", list(SAMPLINGS), ids=list(SAMPLINGS))
@pytest.mark.parametrize(("draw", "rule"), CORRECT_RULES, ids=[f"{d}-{r}" for d, r in CORRECT_RULES])
def test_exact_enumeration_equals_target(sampling, draw, rule):
    target, draft = _models()
    sp = SAMPLINGS[sampling]
    tf, df = model_fn(target, sp), model_fn(draft, sp)
    law = exact_step_law(tf, df, TREE, CONTEXT, draw=draw, rule=rule)
    assert abs(sum(law.values()) - 1.0) < 1e-12
    assert max(len(s) for s in law) >= 2  # drafts do get accepted
    expected = target_sequence_distribution(target, num_tokens=3, context=CONTEXT, sampling=sp)
    assert total_variation(complete(law, tf, CONTEXT, 3), expected) < 1e-12


def test_exact_enumeration_sees_a_mismatched_residual():
    target, draft = _models()
    sp = SAMPLINGS["T=1"]
    tf, df = model_fn(target, sp), model_fn(draft, sp)
    expected = target_sequence_distribution(target, num_tokens=3, context=CONTEXT, sampling=sp)
    for draw, rule in [("without", "with"), ("with", "without")]:
        law = complete(exact_step_law(tf, df, TREE, CONTEXT, draw=draw, rule=rule), tf, CONTEXT, 3)
        assert total_variation(law, expected) > 0.05, (draw, rule)


def _engine_counts(mode: str, sp: SamplingParams, seed: int, verify_replacement: bool | None = None):
    target, draft = _models()
    return sample_output_distribution(
        TreeMarkovTarget(target),
        TreeMarkovDrafter(draft, TREE, mode=mode, verify_replacement=verify_replacement),
        num_samples=NUM_SAMPLES,
        gamma=TREE.max_depth,
        context=CONTEXT,
        num_tokens=NUM_TOKENS,
        sampling=sp,
        via="generate",
        seed=seed,
        batch_size=NUM_SAMPLES,
    )


@pytest.mark.slow  # 5-7 s a case on 2 cores
@pytest.mark.parametrize("sampling", list(SAMPLINGS), ids=list(SAMPLINGS))
@pytest.mark.parametrize("mode", ["without", "with", "top"])
def test_generate_with_trees_matches_target(mode, sampling):
    sp = SAMPLINGS[sampling]
    target, _ = _models()
    expected = target_sequence_distribution(target, num_tokens=NUM_TOKENS, context=CONTEXT, sampling=sp)
    counts = _engine_counts(mode, sp, seed=7)
    assert sum(counts.values()) == NUM_SAMPLES
    assert_same_distribution(counts, expected, alpha=ALPHA, label=f"tree {mode} {sampling}")


@pytest.mark.slow  # about 5 s on 2 cores
def test_planted_residual_bug_is_caught():
    """Children drawn without replacement but verified with the i.i.d. (SpecInfer) residual."""
    sp = SAMPLINGS["T=1"]
    target, draft = _models()
    tf, df = model_fn(target, sp), model_fn(draft, sp)
    expected = target_sequence_distribution(target, num_tokens=NUM_TOKENS, context=CONTEXT, sampling=sp)
    # The bug's exact bias on this run's output: first token from the target, then one buggy step.
    biased = {}
    for (x,), px in complete({(y,): p for y, p in enumerate(tf(CONTEXT))}, tf, CONTEXT, 1).items():
        step = exact_step_law(tf, df, TREE, CONTEXT + (x,), draw="without", rule="with")
        for seq, pr in complete(step, tf, CONTEXT + (x,), NUM_TOKENS - 1).items():
            biased[(x,) + seq] = biased.get((x,) + seq, 0.0) + px * pr
    tv = total_variation(biased, expected)
    assert required_sample_size(tv, num_cells=len(expected), alpha=ALPHA, beta=BETA) < NUM_SAMPLES
    counts = _engine_counts("without", sp, seed=11, verify_replacement=True)
    result = goodness_of_fit(counts, expected, alpha=ALPHA)
    assert not result.passed, f"planted bug (TV {tv:.3f}) not detected: {result}"
