"""Backend registries and backend selection shared by every op in `kernels`.

Each op family (grouped GEMM, routing) keeps a registry that maps a backend name ("torch", "triton", or a
third-party name) to an implementation object. `select_backend` resolves the name for one call:

    environment variable (if set)  >  the `backend` argument  >  automatic (Triton on CUDA, torch elsewhere)

(grouped_gemm's own `select_backend` then swaps the automatic "torch" for "onednn" on float32 CPU tensors.)

The environment variable wins over the argument on purpose: it lets a researcher force the plain-PyTorch
path for a whole run (to rule out a kernel bug, say) without editing model code that passes a backend.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from typing import Generic, TypeVar

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from kernels.registry import Registry

B = TypeVar("B")


@functools.cache
def triton_available() -> bool:
    """True when the `triton` package can be imported (it is never imported here)."""
    if "triton" in sys.modules:  # imported already, or blocked with sys.modules["triton"] = None
        return sys.modules["triton"] is not None
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    """True when Triton kernels run under the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_usable_on(device: torch.device) -> str | None:
    """Why Triton kernels cannot run on tensors of `device`, or None when they can."""
    if not triton_available():
        return "the triton package is not installed"
    if triton_interpreting():
        return None if device.type == "cpu" else f"TRITON_INTERPRET=1 needs CPU tensors, got {device}"
    if device.type != "cuda":
        return f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 with CPU tensors), got {device}"
    return None


class BackendRegistry(Registry, Generic[B]):
    """Name -> implementation for one op family (a :class:`kernels.registry.Registry`), with the
    environment variable that overrides the choice and the automatic pick per device."""

    def __init__(self, family: str, env_var: str) -> None:
        super().__init__(f"{family} backend", f"kernels.{family.replace(' ', '_').lower()}_backends")
        self.family = family
        self.env_var = env_var

    def register(self, name: str, impl: B) -> B:  # type: ignore[override]
        """Add (or replace) the implementation called `name`; returns `impl`."""
        if not name or not name.isidentifier():
            raise ValueError(f"backend name must be a Python identifier, got {name!r}")
        return super().register(name, impl)

    def env_override(self) -> str:
        """The backend name set in the environment variable, or "" when unset."""
        return os.environ.get(self.env_var, "").strip()

    def select(self, backend: str | None, device: torch.device) -> str:
        """Resolve the backend name for tensors on `device` (see the module docstring for the order)."""
        env = self.env_override()
        if env:
            if env not in self:
                raise ValueError(
                    f"environment variable {self.env_var}={env!r} names no {self.family} backend; "
                    f"known backends: {', '.join(self.names())}"
                )
            name = env
        elif backend is None:
            name = "triton" if device.type == "cuda" and triton_usable_on(device) is None else "torch"
        elif backend not in self:
            raise ValueError(f"backend must be None or one of {', '.join(self.names())}, got {backend!r}")
        else:
            name = backend
        if name == "triton":
            reason = triton_usable_on(device)
            if reason is not None:
                raise ValueError(f"backend 'triton' cannot run here: {reason}")
        return name


def can_check_values() -> bool:
    """Whether value checks that read a tensor back to the host are allowed right now.

    They are skipped while torch.compile traces (the values are symbolic) and while a CUDA graph is
    captured (a device-to-host copy would break the capture). Everywhere else they run.
    """
    if torch.compiler.is_compiling():
        return False
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False
    return True


def eager_direct_call(*tensors: torch.Tensor | None) -> bool:
    """Whether an op may call its backend directly instead of going through its custom op.

    True in plain eager mode when no input needs a gradient: then the custom op adds nothing but its
    dispatch cost (~25 us per call on CPU, a visible share of a decode step at T = 1). Under
    torch.compile, a dispatch mode (FakeTensor, make_fx), tensor subclasses or autograd, the custom op
    is used, so tracing and gradients always see it.
    """
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or (grad and t.requires_grad):
            return False
    return True
