"""``python -m specdec.bench.draft_floor``'s pieces on the tiny Llama and its EAGLE head: the head's bytes
per forward, and a level's drafting time per engine step (timed where the engine calls the drafter)."""

from __future__ import annotations

import pytest
from test_eagle_slots import MAX_LEN, PROMPTS, tiny  # noqa: F401  (tiny: a fixture)

from specdec.bench.draft_floor import head_bytes, markdown, measure_level
from specdec.engine import Engine

pytestmark = pytest.mark.usefixtures("one_thread")


def test_head_bytes_are_its_packed_weights(tiny):  # noqa: F811
    engine = Engine(tiny["target"], drafter="eagle", drafter_options={"weights": tiny["weights"]}, gamma=2,
                    max_num_seqs=1, max_model_len=MAX_LEN, measure_cost=False)  # fmt: skip
    head = engine.drafter.head
    b = head_bytes(head)
    assert b["layer"] == sum(
        lin.nbytes for lin in (head.fc, head.qkv_proj, head.o_proj, head.gate_up_proj, head.down_proj)
    )
    assert b["lm_head"] == head.lm_head.nbytes > 0 and b["aux"] == head.fc_aux.nbytes > 0  # aux_layers=(0,)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_level_times_every_drafting_step(tiny, temperature):  # noqa: F811
    target = tiny["target"]
    level = measure_level(
        target, [PROMPTS[0], PROMPTS[1]], drafter="eagle", rows=2, depth=2, temperature=temperature,
        max_new_tokens=12, drafter_options={"weights": tiny["weights"]}, max_model_len=MAX_LEN,
    )  # fmt: skip
    assert level["steps"] >= 3 and level["draft_ms"] > level["catch_up_ms"] > 0
    level |= {"floor_ms": 0.1, "over_floor": 1.0, "over_greedy": 1.0, "over_one_row": 1.0}
    text = markdown({"environment": {"commit": "x"}, "read_bandwidth_gb_s": 1.0, "command": "c",
                     "head_bytes": {"layer": 1, "lm_head": 1, "aux": 0}, "levels": [level]})  # fmt: skip
    assert "| 2 |" in text
