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

__all__ = ["capture_env", "describe_machine"]

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
    """The accelerator torch sees (torch is imported only if installed; triton never is)."""
    if _version("torch") is None:
        return {"device": "cpu", "device_name": _cpu_model(), "device_count": 0}
    import torch

    if torch.cuda.is_available():
        return {
            "device": "cuda",
            "device_name": torch.cuda.get_device_name(0),
            "device_count": torch.cuda.device_count(),
            "cuda_version": torch.version.cuda,
        }
    return {"device": "cpu", "device_name": _cpu_model(), "device_count": 0}


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
    if env.get("device") == "cuda":
        device = f"{env.get('device_count', 1)}x {env.get('device_name')}"
    else:
        device = f"CPU ({env.get('device_name') or env.get('cpu_model')}, {env.get('cpu_affinity')} cores)"
    return f"{device}, host {env.get('hostname')}, torch {env.get('torch')}"
