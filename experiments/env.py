"""What machine and software a run came from: the contents of ``env.json``."""

from __future__ import annotations

import functools
import os
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from specdec.summary import utc_now

__all__ = ["capture_env", "describe_machine", "target_placement"]

REPO_ROOT = Path(__file__).resolve().parent.parent
_PACKAGES = ("torch", "transformers", "triton", "numpy", "scipy", "wandb", "specdec")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, timeout=20, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _device() -> dict[str, Any]:
    """What the machine offers: ``cuda_available`` and, when it is, the first GPU's name, the count and
    the CUDA version (torch is imported only if installed; triton never is). ``device`` /
    ``device_name`` start as the CPU: a run that opens a model on a GPU records it
    (:func:`target_placement`), so ``device`` is what the run used, never only what was visible."""
    env: dict[str, Any] = {"device": "cpu", "device_name": _cpu_model(), "cuda_available": False}
    if _version("torch") is None:
        return env
    import torch

    if torch.cuda.is_available():
        env.update(
            cuda_available=True,
            cuda_device_name=torch.cuda.get_device_name(0),
            cuda_device_count=torch.cuda.device_count(),
            cuda_version=torch.version.cuda,
        )
    return env


def target_placement(target: Any) -> dict[str, Any]:
    """Where an opened target runs, for ``env.json``: ``device`` (``cpu``, ``cuda:0``), its
    ``device_name`` (the GPU's, or the CPU model), ``dtype`` (what its activations and cache are in:
    the native target's compute dtype, a ``transformers`` model's parameters' dtype) and ``weights``
    (the native target's weight format, else None)."""
    import torch

    device = torch.device(getattr(target, "device", "cpu"))
    dtype = getattr(target, "dtype", None)
    model = getattr(target, "model", None)
    if not isinstance(dtype, torch.dtype) and isinstance(model, torch.nn.Module):
        dtype = next(model.parameters()).dtype
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        device, name = torch.device("cuda", index), torch.cuda.get_device_name(index)
    else:
        name = _cpu_model() if device.type == "cpu" else device.type
    return {
        "device": str(device),
        "device_name": name,
        "dtype": str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else None,
        "weights": getattr(target, "weights", None),
    }


@functools.lru_cache(maxsize=1)
def _static_env() -> dict[str, Any]:
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    env: dict[str, Any] = {
        "python": platform.python_version(),
        **{name: _version(name) for name in _PACKAGES},
        "git_commit": commit,
        "git_dirty": bool(status) if status is not None else None,
        **_device(),
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "cpu_model": _cpu_model(),
        "platform": platform.platform(),
    }
    return env


def capture_env() -> dict[str, Any]:
    """Versions (python, torch, transformers, triton, ...), git commit, device, host, CPUs, argv, time."""
    return {**_static_env(), "argv": list(sys.argv), "time": utc_now()}


def describe_machine(env: dict[str, Any]) -> str:
    """One line naming the machine of an ``env.json``: device, CPU count, host, torch version."""
    if str(env.get("device", "")).startswith("cuda"):
        device = f"{env.get('device_name')} ({env.get('device')}, {env.get('dtype') or 'default dtype'})"
    else:
        device = f"CPU ({env.get('device_name') or env.get('cpu_model')}, {env.get('cpu_affinity')} cores)"
    return f"{device}, host {env.get('hostname')}, torch {env.get('torch')}"
