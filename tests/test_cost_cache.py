"""The verify-cost grid kept per machine and architecture (:mod:`specdec.engine.cost_cache`): measured
carefully once, then read by every process with the same key; never for a target that says nothing
of its cost, nor under ``SPECDEC_VERIFY_COST=measure`` (the suite's setting, conftest.py)."""

from __future__ import annotations

import json

import pytest

from specdec.engine import cost_cache, cost_model
from specdec.engine.cost_cache import CAREFUL_ROUNDS, cost_cache_dir, grid_key, verify_cost_for


class Counted:
    """A target whose forward of B rows of T tokens costs 1 + 0.5 B T on a fake clock; it counts its
    forwards and says what its cost depends on (``identity``)."""

    vocab_size = 16

    def __init__(self, clock: list[float], identity: str | None = "arch-a") -> None:
        self.clock, self.forwards = clock, 0
        if identity is not None:
            self.cost_identity = lambda: {"arch": identity}

    def forward(self, tokens_BT, start_B, *, rows_B=None):
        B, T = tokens_BT.shape
        self.clock[0] += 1.0 + 0.5 * B * T
        self.forwards += 1

    def rollback(self, lengths_B, rows_B=None) -> None:
        pass


@pytest.fixture
def clock(monkeypatch, tmp_path) -> list[float]:
    now = [0.0]
    monkeypatch.setattr(cost_model.time, "perf_counter", lambda: now[0])
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setenv("SPECDEC_VERIFY_COST", "cache")
    return now


def test_a_grid_is_measured_carefully_once_then_read_by_a_new_target_with_the_same_key(clock):
    first = Counted(clock)
    grid = verify_cost_for(first, max_rows=2)
    assert first.forwards > CAREFUL_ROUNDS * 2 * 5  # every round: each (B, T) point, 3+ forwards
    assert grid.cost(2, 3) == pytest.approx(1.0 + 0.5 * 2 * 3)
    kept = list(cost_cache_dir().glob("*.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text())["key"]["target"] == {"arch": "arch-a"}
    second = Counted(clock)  # another process's target: the kept grid, no forward
    assert verify_cost_for(second, max_rows=2) == grid and second.forwards == 0
    other = Counted(clock, identity="arch-b")  # another architecture: its own grid
    verify_cost_for(other, max_rows=2)
    assert other.forwards > 0 and len(list(cost_cache_dir().glob("*.json"))) == 2
    rows = Counted(clock)  # another row count: its own grid
    verify_cost_for(rows, max_rows=4)
    assert rows.forwards > 0 and len(list(cost_cache_dir().glob("*.json"))) == 3


def test_an_unreadable_kept_grid_is_measured_again_and_replaced(clock):
    verify_cost_for(Counted(clock), max_rows=1)
    (path,) = cost_cache_dir().glob("*.json")
    path.write_text("{not json")
    again = Counted(clock)
    grid = verify_cost_for(again, max_rows=1)
    assert again.forwards > 0 and json.loads(path.read_text())["grid"] == grid.to_dict()


def test_nothing_is_kept_without_an_identity_or_under_measure(clock, monkeypatch):
    anonymous = Counted(clock, identity=None)
    assert grid_key(anonymous, max_rows=1) is None
    verify_cost_for(anonymous, max_rows=1)
    assert anonymous.forwards > 0 and not cost_cache_dir().exists()
    monkeypatch.setenv("SPECDEC_VERIFY_COST", "measure")
    assert grid_key(Counted(clock), max_rows=1) is None
    verify_cost_for(Counted(clock), max_rows=1)
    assert not cost_cache_dir().exists()
    monkeypatch.setenv("SPECDEC_VERIFY_COST", "always")
    with pytest.raises(ValueError, match="SPECDEC_VERIFY_COST must be 'cache' or 'measure'"):
        grid_key(Counted(clock), max_rows=1)


def test_the_key_names_the_machine_and_the_rows(clock):
    key = grid_key(Counted(clock), max_rows=3)
    assert key["max_rows"] == 3 and key["target"] == {"arch": "arch-a"}
    assert {"cpu", "isa", "threads", "torch"} <= set(key["machine"])
    assert cost_cache._path(key) != cost_cache._path(grid_key(Counted(clock), max_rows=4))
