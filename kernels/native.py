"""Build a C source of this package once per machine and ISA path, and load it with ctypes.

The project's CPU kernels (the packed GEMM in ``kernels/csrc``, the fused MoE routing in
``kernels/routing/csrc``) are single C files compiled with the system compiler. Each is built for
one **ISA path** (:data:`ISA_FLAGS`):

- ``avx512``: ``-march=x86-64-v4`` (AVX-512 F/BW/DQ/VL, 16-float vectors, its own tile shapes);
- ``avx512-vnni``: ``avx512`` plus AVX-512 VNNI (``vpdpbusd``: the 8-bit dot products of the
  ``q8a8`` / ``q4a8`` formats in one instruction; Ice Lake, Sapphire Rapids, Zen 4 and later);
- ``avx2``: ``-march=x86-64-v3`` (AVX2, FMA, F16C: 8-float vectors, its own tile shapes);
- ``avx2-vnni``: ``avx2`` plus AVX-VNNI (the VEX ``vpdpbusd`` of Alder Lake and later client CPUs
  without AVX-512);
- ``generic``: the compiler's baseline for the architecture (SSE2 on x86-64, NEON on aarch64), the
  portable fallback for every other CPU.

A ``-vnni`` path packs weights exactly as its base path (:func:`base_isa`): only the 8-bit dot
products change instruction.

:func:`cpu_isa` picks the best path this CPU runs (from its feature flags); the environment variable
``SPECDEC_CPU_ISA`` forces one (``avx2`` on an AVX-512 machine builds and runs the AVX2 path, as
most users' CPUs would; asking for a path the CPU lacks is a ``ValueError``). No build step at
install time: the first call compiles into ``$SPECDEC_CACHE/kernels`` (default
``~/.cache/specdec/kernels``), keyed by the source, the compiler, the flags and the ISA; later calls,
and other processes, load the cached file. The write is atomic, so concurrent builders never load a
half-written library.

OpenMP: the library links ``libgomp.so.1``, the soname PyTorch's own OpenMP runtime has on Linux, so
the loader binds it to the runtime already in the process and both share one thread team.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = [
    "ISA_FLAGS",
    "base_isa",
    "build_library",
    "cache_dir",
    "cache_root",
    "cpu_isa",
    "cpu_signature",
    "cpu_model",
    "runnable_isas",
]

COMMON_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "avx512-vnni": ("-march=x86-64-v4", "-mavx512vnni", "-mprefer-vector-width=512"),
    "avx512": ("-march=x86-64-v4", "-mprefer-vector-width=512"),
    "avx2-vnni": ("-march=x86-64-v3", "-mavxvnni"),
    "avx2": ("-march=x86-64-v3",),
    "generic": (),
}
"""Compiler flags of each ISA path (added to ``-O3 -fopenmp -shared -fPIC``), best first."""
_AVX512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma", "f16c"}
_AVX2 = {"avx2", "fma", "f16c", "bmi2"}
_NEEDS = {
    "avx512-vnni": _AVX512 | {"avx512_vnni"},
    "avx512": _AVX512,
    "avx2-vnni": _AVX2 | {"avx_vnni"},
    "avx2": _AVX2,
    "generic": set(),
}
LIBS = ("-lm",)


def cache_root() -> Path:
    """The project's cache: ``$SPECDEC_CACHE``, or ``~/.cache/specdec`` (converted checkpoints, kernels)."""
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))


def cache_dir() -> Path:
    """Where built kernels live: ``cache_root() / "kernels"``."""
    return cache_root() / "kernels"


@functools.cache
def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def cpu_signature() -> str:
    """The CPU's model name and feature flags."""
    lines = _cpuinfo()
    if lines:
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags", "Features"))}))
    return platform.machine() + platform.processor()


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what ``platform`` knows."""
    for line in _cpuinfo():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _flags() -> set[str]:
    for line in _cpuinfo():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def runnable_isas() -> list[str]:
    """The ISA paths this CPU can run, best first (``generic`` always)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ["generic"]
    have = _flags()
    return [isa for isa in ISA_FLAGS if isa != "generic" and _NEEDS[isa] <= have] + ["generic"]


def base_isa(isa: str) -> str:
    """The path whose vector width, tiles and packed layouts ``isa`` shares (``avx512-vnni`` ->
    ``avx512``)."""
    if isa not in ISA_FLAGS:
        raise ValueError(f"isa must be one of {sorted(ISA_FLAGS)}, got {isa!r}")
    return isa.removesuffix("-vnni")


def cpu_isa() -> str:
    """The ISA path the kernels run: ``$SPECDEC_CPU_ISA`` when set, else the best this CPU runs."""
    forced = os.environ.get("SPECDEC_CPU_ISA", "").strip()
    runnable = runnable_isas()
    if forced:
        if forced not in ISA_FLAGS:
            raise ValueError(f"SPECDEC_CPU_ISA must be one of {sorted(ISA_FLAGS)}, got {forced!r}")
        if forced not in runnable:
            raise ValueError(
                f"SPECDEC_CPU_ISA={forced!r} asks for a path this CPU cannot run "
                f"(it runs {', '.join(runnable)})"
            )
        return forced
    return runnable[0]


def build_library(source: Path, *, isa: str | None = None, libs: tuple[str, ...] = LIBS) -> ctypes.CDLL:
    """Compile ``source`` for an ISA path (default :func:`cpu_isa`), once per machine, and load it.
    The cache key covers every ``.c`` file beside it (a source may include another).

    Raises ``RuntimeError`` when there is no C compiler (set ``CC``) or the build fails; callers keep a
    PyTorch path for that case.
    """
    isa = cpu_isa() if isa is None else isa
    if isa not in ISA_FLAGS:
        raise ValueError(f"isa must be one of {sorted(ISA_FLAGS)}, got {isa!r}")
    return _build(Path(source), isa, tuple(libs))


def _build(source: Path, isa: str, libs: tuple[str, ...]) -> ctypes.CDLL:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError(f"no C compiler found (set CC) to build {source.name}")
    cflags = (*COMMON_FLAGS, *ISA_FLAGS[isa])
    text = b"".join(p.read_bytes() for p in [source, *sorted(source.parent.glob("*.c"))])
    key = hashlib.sha256(
        text + " ".join((cc, *cflags, *libs)).encode() + platform.machine().encode()
    ).hexdigest()
    out = cache_dir() / f"{source.stem}-{isa}-{key[:16]}.so"
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
                raise RuntimeError(f"building {source.name} ({isa}) with {cc} failed:\n{proc.stderr[-2000:]}")
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(out))
