"""A request fails alone.

Whatever raises while one row of a step is drafted, verified, committed or observed finishes that
request with ``finish_reason`` ``"error"`` (its message in ``RequestOutput.error``) and leaves the
other rows of the step to go on as they would have.

The runner calls the drafter, the target and the rule over many rows at once. Where such a call
raises, :func:`each_alone` calls it again for each row alone: a row whose own call raises fails, the
others go on with their own results. That is exact for the rows that go on, because a row's result
never depends on the other rows of a call: a slot drafter's batched ``propose`` is each row alone,
a target forward writes a row's cache entries and gives its logits whatever else is in the block
(batch invariance), and the rule reads only the row's logits, drafts and keyed noise.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

__all__ = ["each_alone", "error_message", "log"]

log = logging.getLogger("specdec.engine")

Item = TypeVar("Item")
Result = TypeVar("Result")

_MAX_MESSAGE = 500  # characters of an error's text kept in a request's output


def each_alone(
    items: Sequence[Item],
    call: Callable[[list[Item]], Result],
    fail: Callable[[Item, Exception], None],
) -> list[tuple[list[Item], Result]]:
    """``call`` over every item at once; where it raises, ``call`` over each item alone, and
    ``fail(item, error)`` for each item whose own call raises. Returns the calls that returned, as
    (their items, their result): one pair for all the items where nothing raised."""
    items = list(items)
    try:
        return [(items, call(items))]
    except Exception as err:
        if len(items) == 1:
            fail(items[0], err)
            return []
    done = []
    for item in items:
        try:
            done.append(([item], call([item])))
        except Exception as err:
            fail(item, err)
    return done


def error_message(where: str, err: BaseException) -> str:
    """The text a failed request reports: where it failed and the error, at most 500 characters."""
    text = f"{where} failed: {type(err).__name__}: {err}"
    return text if len(text) <= _MAX_MESSAGE else text[: _MAX_MESSAGE - 3] + "..."
