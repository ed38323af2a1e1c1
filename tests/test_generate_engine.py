"""``specdec.generate`` over the engine: each row's tokens depend on its prompt, settings, seed and
drafter only, never on the other prompts of the call, whichever way the engine groups rows
(``specdec.engine.units``): a batched drafter's cohort (one ``propose`` for many rows, keyed draws), per
row drafters whose chains are merged for one rule call, and token trees shared by a cohort.

Legend: B prompts of a call.
"""

from __future__ import annotations

import pytest
import torch
from _tiny import TableTarget, random_table
from _tree_toys import TreeMarkovDrafter, TreeMarkovTarget

import specdec
from specdec.drafters.model import ModelDrafter
from specdec.testing import MarkovModel
from specdec.verify.token_tree import TokenTree

TARGET = MarkovModel.random(6, order=2, seed=61, eos_token_ids=(5,))
DRAFT = MarkovModel.random(6, order=1, seed=62)
PROMPTS = [[1, 2], [3], [1, 2], [4, 0, 2], [1, 2], [2, 2, 2, 1]]


def _alone(target_fn, drafter_fn, out, b: int, **kw):
    """Row b of ``out`` decoded alone: its prompt, the seed it was keyed by."""
    return specdec.generate(
        target_fn(), [out.prompt_token_ids[b]], drafter=drafter_fn(), seed=out.seeds[b], **kw
    )


@pytest.mark.parametrize("verify", ["exact", "gumbel"])
@pytest.mark.parametrize(
    "kind", ["batched-sampled", "batched-point-mass", "per-row-model", "tree-without", "tree-with"]
)
def test_a_row_is_what_it_is_alone(kind, verify):
    kw = dict(max_new_tokens=8, temperature=1.0, gamma=3, eos_token_ids=[5], verify=verify)
    if kind.startswith("batched"):
        target_fn = TARGET.as_target
        drafter_fn = lambda: DRAFT.as_drafter(point_mass=kind.endswith("point-mass"))  # noqa: E731
    elif kind == "per-row-model":
        table = random_table(6, seed=3)
        target_fn = lambda: TableTarget(table, eos_token_ids=(5,))  # noqa: E731
        drafter_fn = lambda: ModelDrafter(
            TableTarget(table), num_slots=8, model=TableTarget(random_table(6, seed=4))
        )  # noqa: E731
    else:
        tree = TokenTree.from_branching([2, 2])
        target_fn = lambda: TreeMarkovTarget(TARGET)  # noqa: E731
        drafter_fn = lambda: TreeMarkovDrafter(DRAFT, tree, mode=kind.split("-")[1])  # noqa: E731
        kw["gamma"] = tree.max_depth
    out = specdec.generate(target_fn(), PROMPTS, drafter=drafter_fn(), seed=7, **kw)
    assert out.seeds[0] == 7 and len(set(out.seeds)) == len(PROMPTS)
    assert out.metrics.num_proposed > 0
    for b in range(len(PROMPTS)):
        assert _alone(target_fn, drafter_fn, out, b, **kw).token_ids[0] == out.token_ids[b], b
    # the same prompt under different seeds: different samples (rows 0, 2, 4 share a prompt)
    assert len({tuple(out.token_ids[b]) for b in (0, 2, 4)}) > 1
    again = specdec.generate(target_fn(), PROMPTS, drafter=drafter_fn(), seed=7, **kw)
    assert again.token_ids == out.token_ids


def test_a_batched_drafter_is_one_instance_and_draws_keyed():
    """The engine serves every row with the batched drafter object itself (no copies), and its draws
    for a row depend on that row's seed and position only."""
    from specdec.drafters.engine_drafter import make_slot_drafter
    from specdec.drafters.request_slots import CohortSlots
    from specdec.protocols import DecodeState
    from specdec.sampling import SamplingParams
    from specdec.verify.noise import PositionNoise

    drafter = DRAFT.as_drafter()
    slots = make_slot_drafter(TARGET.as_target(), drafter, None, num_slots=4)
    assert isinstance(slots, CohortSlots) and slots.keyed and slots.drafter is drafter
    tokens = torch.tensor([[1, 2, 0, 0], [3, 1, 0, 0]])
    state = DecodeState(tokens, torch.tensor([2, 1]), torch.tensor([2, 2]), torch.zeros(2, dtype=torch.bool),
                        SamplingParams())  # fmt: skip
    both = drafter.propose(state, 3, None, noise=PositionNoise([11, 12]))
    one = DecodeState(tokens[1:], torch.tensor([1]), torch.tensor([2]), torch.zeros(1, dtype=torch.bool),
                      SamplingParams())  # fmt: skip
    alone = drafter.propose(one, 3, None, noise=PositionNoise([12]))
    assert torch.equal(both.tokens_BK[1:], alone.tokens_BK)
