"""A step's one device-to-host copy: what the scheduler needs, gathered on the device, read once.

Legend: G rows of a unit, A committed path length (accepted tokens + 1).

On an accelerator each read of a device value waits for the device (a synchronisation), so an
engine step collects what the host must know on the device first: per unit of rows the committed
tokens ``tokens_GA``, the accepted counts ``accepted_G`` (and a tree's path), and the bool faults
of the step's checks (:func:`specdec.checks.logits_faults`, :func:`~specdec.checks.proposal_faults`),
then copies them in one read (:meth:`HostTransfer.fetch`). Another per-row value joins the same
read with one more :meth:`HostTransfer.add` (an int, bool or float tensor of any shape: floats
travel bit-exact as float64 bits inside the int64 buffer).
"""

from __future__ import annotations

import numpy as np
import torch

from specdec.host_sync import avoids_host

__all__ = ["HostTransfer"]


class HostTransfer:
    """Named tensors bound for the host, copied together (one read) by :meth:`fetch`.

    Args:
        device: where the parts are gathered (the target's device); a part elsewhere moves there
            first (a host-to-device copy, which does not wait for the device).
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._parts: list[tuple[str, torch.Tensor]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue ``tensor`` (integer, bool or floating point, any shape) under ``name``."""
        if any(name == n for n, _ in self._parts):
            raise ValueError(f"name {name!r} is already in this transfer")
        if not isinstance(tensor, torch.Tensor) or tensor.is_complex():
            raise ValueError(f"{name} must be a real tensor, got {type(tensor).__name__}")
        self._parts.append((name, tensor))

    def fetch(self) -> dict[str, np.ndarray]:
        """Every part as a numpy array of its shape (int64, bool or float64), after one read."""
        if not self._parts:
            return {}
        words = []
        for _, t in self._parts:
            flat = t.reshape(-1).to(self.device)
            if flat.is_floating_point():
                flat = flat.to(torch.float64).view(torch.int64)
            words.append(flat.to(torch.int64))
        joined = torch.cat(words)
        if avoids_host(joined):
            joined = joined.to("cpu", copy=True)  # the step's one read
        host = joined.numpy()
        out: dict[str, np.ndarray] = {}
        at = 0
        for name, t in self._parts:
            n = t.numel()
            part = host[at : at + n].reshape(tuple(t.shape))
            at += n
            if t.is_floating_point():
                part = part.view(np.float64)
            elif t.dtype == torch.bool:
                part = part.astype(bool)
            out[name] = part
        return out
