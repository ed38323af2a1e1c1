"""Drive an engine through arrivals in tests: requests added at given steps, stepped until all finish,
with the streaming contract checked on the way."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specdec.engine import Engine, RequestOutput


@dataclass
class Arrival:
    step: int  # the engine step before which it is added
    key: Any
    prompt: list[int]
    settings: dict[str, Any] = field(default_factory=dict)


def drive(
    engine: Engine,
    arrivals: list[Arrival],
    *,
    before_step: Callable[[int], None] | None = None,
    after_step: Callable[[int, list[RequestOutput]], list[RequestOutput] | None] | None = None,
    max_steps: int = 2000,
) -> dict[Any, RequestOutput]:
    """Run the engine until every arrival has finished; the final output per key. Checks the
    streaming contract on the way: one output per request per step, ``new_token_ids`` adding up to
    ``token_ids``, nothing after ``finished``. ``after_step`` may return outputs of its own
    (``engine.abort``'s), taken as that step's."""
    pending = sorted(arrivals, key=lambda a: a.step)
    keys: dict[str, Any] = {}
    finals: dict[Any, RequestOutput] = {}
    streams: dict[Any, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            keys[engine.add_request(a.prompt, **a.settings)] = a.key
        if before_step is not None:
            before_step(step)
        outputs = engine.step()
        assert len({o.request_id for o in outputs}) == len(outputs), "two outputs for one request"
        extra = after_step(step, outputs) if after_step is not None else None
        for o in outputs + (extra or []):
            key = keys[o.request_id]
            assert key not in finals, f"request {key} changed after it finished"
            streams.setdefault(key, []).extend(o.new_token_ids)
            assert o.token_ids == streams[key]
            if o.finished:
                finals[key] = o
        step += 1
        assert step < max_steps, "the engine did not finish"
    assert set(finals) == {a.key for a in arrivals}
    return finals
