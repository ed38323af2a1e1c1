"""Build a C source of this package once per machine and load it with ctypes.

The project's CPU kernels (the packed GEMM in ``kernels/csrc``, the fused MoE routing in
``kernels/routing/csrc``) are single C files compiled with the system compiler
(``cc -O3 -march=native -fopenmp``). No build step at install time: the first call compiles into
``$SPECDEC_CACHE/kernels`` (default ``~/.cache/specdec/kernels``), keyed by the source, the compiler
and flags, and the CPU (a ``-march=native`` build is never loaded on a different CPU); later calls,
and other processes, load the cached file. The write is atomic, so concurrent builders never load a
half-written library.

OpenMP: the library links ``libgomp.so.1``, the soname PyTorch's own OpenMP runtime has on Linux, so
the loader binds it to the runtime already in the process and both share one thread team.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["CFLAGS", "build_library", "cache_dir", "cache_root", "cpu_signature"]

CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
LIBS = ("-lm",)


def cache_root() -> Path:
    """The project's cache: ``$SPECDEC_CACHE``, or ``~/.cache/specdec`` (converted checkpoints, kernels)."""
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))


def cache_dir() -> Path:
    """Where built kernels live: ``cache_root() / "kernels"``."""
    return cache_root() / "kernels"


def cpu_signature() -> str:
    """The CPU's model name and feature flags (what ``-march=native`` compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags", "Features"))}))
    except OSError:
        return platform.machine() + platform.processor()


def build_library(
    source: Path, *, cflags: tuple[str, ...] = CFLAGS, libs: tuple[str, ...] = LIBS
) -> ctypes.CDLL:
    """Compile ``source`` (once per machine, source and flags) and load it.

    Raises ``RuntimeError`` when there is no C compiler (set ``CC``) or the build fails; callers keep a
    PyTorch path for that case.
    """
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError(f"no C compiler found (set CC) to build {source.name}")
    text = source.read_bytes()
    key = hashlib.sha256(
        text + " ".join((cc, *cflags, *libs)).encode() + cpu_signature().encode()
    ).hexdigest()
    out = cache_dir() / f"{source.stem}-{key[:16]}.so"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so")
        os.close(fd)
        try:
            try:
                proc = subprocess.run(
                    [cc, *cflags, str(source), *libs, "-o", tmp], capture_output=True, text=True
                )
            except OSError as err:  # the compiler named by CC does not exist or cannot run
                raise RuntimeError(f"could not run the C compiler {cc!r}: {err}") from err
            if proc.returncode != 0:
                raise RuntimeError(f"building {source.name} with {cc} failed:\n{proc.stderr[-2000:]}")
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(out))
