"""``specdec.bench.interleave.time_interleaved``, the one timer of every micro-benchmark."""

from __future__ import annotations

import pytest


def test_the_timer_warms_up_rotates_and_takes_a_clock_and_a_hook():
    """``time_interleaved``, the project's one timer: ``warmup`` untimed calls each, then the callables
    in a rotating order; ``before`` runs untimed before every timed call; ``clock`` times one call."""
    from specdec.bench.interleave import time_interleaved, wall_clock

    calls: list[str] = []
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}

    def clock(fn):
        calls.append("clock")
        fn()
        return 0.25

    times = time_interleaved(
        fns, min_reps=3, max_reps=3, warmup=2, before=lambda: calls.append("flush"), clock=clock
    )
    assert times == {"a": [0.25] * 3, "b": [0.25] * 3}
    assert calls[:4] == ["a", "a", "b", "b"]  # warm-up, untimed, no flush
    timed = [c for c in calls[4:] if c in ("a", "b")]
    assert timed == ["a", "b", "b", "a", "a", "b"]  # the order rotates every repetition
    assert calls[4:] == [x for name in timed for x in ("flush", "clock", name)]
    assert time_interleaved({"x": lambda: None}, min_reps=2, max_reps=2, warmup=0)["x"][0] >= 0
    assert wall_clock(lambda: None) >= 0
    with pytest.raises(ValueError, match="boom"):  # the callable's own error, not swallowed
        time_interleaved({"x": lambda: (_ for _ in ()).throw(ValueError("boom"))}, warmup=0)
