"""Host discipline: which code paths may read device values on the host, and a counter of those reads.

On an accelerator every read of a device tensor's values on the host (``.item()``, ``.tolist()``,
``.cpu()``, ``bool(t)``, a boolean-mask index, ``nonzero``, ...) waits for the device to finish all
the work queued before it: a synchronisation. The engine does at most one per decode step, the
step's committed tokens (``specdec.engine.runner``); the verification rules, the keyed noise and the
samplers take **fixed-shape** paths there (no early exit on "every row has stopped", no sparse pass
chosen by a count, no boolean-mask indexing), which compute the same tokens as their host paths.

- :func:`avoids_host` says which path a tensor takes: the fixed-shape one on an accelerator, or on
  the CPU inside :func:`accelerator_paths` (how the CPU tests run the accelerator's code).
- :func:`count_host_syncs` counts the reads of a block of code: on CUDA every synchronising call
  (``torch.cuda.set_sync_debug_mode``); on the CPU the reads of values that derive from a target's
  forward, or from a tensor made or moved with an explicit ``device`` (taint tracking through a
  ``TorchFunctionMode``): what would be a synchronisation if the target ran on an accelerator. The
  CPU count cannot see a read inside a C++ op (one that checks its input's values on the CPU only),
  nor a read of a tensor the code moved to the device without naming one; the CUDA count sees
  everything.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

__all__ = ["avoids_host", "accelerator_paths", "count_host_syncs", "HostSyncs"]

_FORCED: contextvars.ContextVar[bool] = contextvars.ContextVar("accelerator_paths", default=False)


def avoids_host(t: torch.Tensor | torch.device | str) -> bool:
    """True where code must not read ``t``'s values on the host (take the fixed-shape path): ``t`` lives
    on an accelerator, or the caller runs inside :func:`accelerator_paths`."""
    device = t.device if isinstance(t, torch.Tensor) else torch.device(t)
    return device.type != "cpu" or _FORCED.get()


@contextlib.contextmanager
def accelerator_paths() -> Iterator[None]:
    """Run the accelerator's code paths on the CPU (``avoids_host`` is True for every tensor): the
    tests' way to check that those paths give the CPU's tokens and read the host once per step."""
    token = _FORCED.set(True)
    try:
        yield
    finally:
        _FORCED.reset(token)


_T = torch.Tensor
_READS = {
    _T.item, _T.tolist, _T.numpy, _T.cpu, _T.__bool__, _T.__int__, _T.__float__, _T.__index__,
    _T.__array__, _T.nonzero, torch.nonzero, _T.argwhere, torch.argwhere, torch.masked_select,
    _T.masked_select, torch.unique, _T.unique, torch.unique_consecutive, torch.repeat_interleave,
}  # fmt: skip
"""Calls that bring a tensor's values (or a shape that depends on them) to the host."""
_INDEXING = {_T.__getitem__, _T.__setitem__}


def _to_host(func: Any, args: tuple, kwargs: dict) -> bool:
    """A ``Tensor.to`` call that copies to the host: to the CPU from another device, or with
    ``copy=True`` (a move to "the device" is no read where the device is the CPU itself)."""
    if func is not _T.to or not args:
        return False
    if args[0].device.type == "cpu" and not kwargs.get("copy", False):
        return False
    for a in (*args[1:], kwargs.get("device")):
        if isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu":
            return True
    return False


def _to_device(func: Any, args: tuple, kwargs: dict) -> bool:
    """A tensor made or moved with an explicit device (``torch.tensor(..., device=d)``,
    ``x.to(d)``): code written for the device names it; host bookkeeping does not."""
    if kwargs.get("device") is not None:
        return True
    return func is _T.to and any(isinstance(a, (str, torch.device)) for a in args[1:])


@dataclass
class HostSyncs:
    """The reads counted by :func:`count_host_syncs`: ``count`` in all, ``reads`` their names, in order,
    each prefixed ``target:`` where it happened inside the target's own methods (its input checks)."""

    device: torch.device
    count: int = 0
    reads: list[str] = field(default_factory=list)

    @property
    def outside_target(self) -> int:
        """The reads made outside the target's methods: the engine's, rules' and drafters'."""
        return sum(not r.startswith("target:") for r in self.reads)


class _TaintMode(TorchFunctionMode):
    """Marks the outputs of the target's forward and everything computed from them; counts host reads
    of marked tensors (a read's result is host data and is not marked)."""

    def __init__(self, record: HostSyncs) -> None:
        super().__init__()
        self.record = record
        self.marked: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self.in_target = 0

    def mark(self, value: Any) -> Any:
        for t in _tensors(value):
            self.marked[id(t)] = t
        return value

    def _is_marked(self, values: list[Any]) -> bool:
        return any(isinstance(t, torch.Tensor) and self.marked.get(id(t)) is t for t in values)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = tree_flatten((args, kwargs))[0]
        marked = self._is_marked(inputs)
        read = func in _READS or _to_host(func, args, kwargs)
        if func in _INDEXING and len(args) > 1:  # a boolean mask of marked values: a shape from values
            index = tree_flatten(args[1])[0]
            read = any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in index)
            marked_index = self._is_marked(index)
            if read and marked_index:
                self._count(func)
            read = False
        if read and marked:
            self._count(func)
        out = func(*args, **kwargs)
        if not read and _to_device(func, args, kwargs):
            self.mark(out)  # made for the device: on an accelerator it lives there
        if marked and not read:
            self.mark(out)
            name = getattr(func, "__name__", "")
            in_place = name.endswith("_") and not name.startswith("__")
            if (func is _T.__setitem__ or in_place) and args:
                self.mark(args[0])  # written in place
            if "out" in kwargs:
                self.mark(kwargs["out"])
        return out

    def _count(self, func: Any) -> None:
        name = getattr(func, "__name__", str(func))
        self.record.count += 1
        self.record.reads.append(f"target:{name}" if self.in_target else name)


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a value: a tensor, a (nested) list, tuple or dict of them, or a dataclass's fields
    (a target's ``TargetOutput``)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = [getattr(value, f.name) for f in dataclasses.fields(value)]
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


@contextlib.contextmanager
def count_host_syncs(target: Any = None, *, device: Any = None) -> Iterator[HostSyncs]:
    """Count the device-to-host reads of the block: ``with count_host_syncs(target) as syncs:
    engine.step()``, then ``syncs.count``.

    ``device``: where to count (default: ``target.device``, else CUDA when available, else the CPU).
    On CUDA, every synchronising call (``torch.cuda.set_sync_debug_mode("warn")``, whatever made it);
    on the CPU, the reads of values that derive from ``target``'s ``forward`` (see the module doc),
    which needs ``target``. Combine it with :func:`accelerator_paths` to count what the
    accelerator's code paths would read.
    """
    if device is None:
        device = getattr(target, "device", None)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    record = HostSyncs(torch.device(device))
    if record.device.type == "cuda":
        with _count_cuda(record):
            yield record
        return
    if target is None:
        raise ValueError(
            "count_host_syncs on the CPU needs target=: it counts reads of what its forward made"
        )
    mode = _TaintMode(record)
    own = dict(vars(target)) if hasattr(target, "__dict__") else {}
    patched = []
    for name in ("forward", "rollback", "copy_slots"):
        method = getattr(target, name, None)
        if callable(method):
            patched.append(name)
            setattr(target, name, _wrapped(method, mode, mark=name == "forward"))
    try:
        with mode:
            yield record
    finally:
        for name in patched:
            if name in own:
                setattr(target, name, own[name])
            else:
                delattr(target, name)  # back to the class's method


def _wrapped(method: Any, mode: _TaintMode, *, mark: bool) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        mode.in_target += 1
        try:
            out = method(*args, **kwargs)
        finally:
            mode.in_target -= 1
        return mode.mark(out) if mark else out

    return call


@contextlib.contextmanager
def _count_cuda(record: HostSyncs) -> Iterator[None]:
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    for w in caught:
        text = str(w.message)
        if "synchroniz" in text:
            record.count += 1
            record.reads.append(text.splitlines()[0][:120])
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
