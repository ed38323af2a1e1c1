"""Run untrusted Python (HumanEval completions) in a child process that cannot fool the verdict.

What :func:`run_untrusted` does, and what it does not:

- **The verdict.** The program passes only when it runs to its last line: the harness appends a
  write of ``ok`` to a pipe after the program, and requires that and exit status
  0. ``sys.exit(0)`` or ``os._exit(0)`` before a failing assert, an exception, a crash or a timeout
  all fail. (Code that sets out to forge the pipe write can; the runner guards against programs that
  stop early, not against an adversary.)
- **No survivors.** A supervisor process sits between the harness and the program, made a child
  subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``), so every process the program starts, even one in a
  session of its own, becomes its child when orphaned; at the timeout or at exit the supervisor kills
  the program's process group and then every remaining child, until none is left. The harness kills
  the supervisor's own process group if it ever outlives its deadline.
- **Files and network.** The program runs in an empty temporary directory (deleted afterwards) with a
  scrubbed environment (``PATH``, ``HOME`` and ``TMPDIR`` pointing there, ``LC_ALL``, ``PYTHONHASHSEED``)
  and ``python -I`` (no user site, no ``PYTHON*`` variables). On Linux with Landlock (kernel 5.13+;
  :func:`landlock_abi`), before any program line runs it restricts itself: read access only to the
  Python installation, system libraries and configuration (``/usr``, ``/lib*``, ``/etc``, ``/proc``,
  ``/dev``), write access only to the temporary directory (and ``/dev/null``), and with Landlock ABI 4+
  no TCP connect or bind. Without Landlock (older kernels, other systems) these file and network limits
  are not there: the program can then read and write what the user can.
- **Resources.** Address space (2 GiB), CPU seconds (the timeout + 1), file size (1 MiB), open
  files (256) and core dumps (none) are limited with ``setrlimit``.

Linux only for the supervisor and Landlock; elsewhere the program still runs in its own session with
the timeout and resource limits, and :data:`SandboxResult.isolation` says what applied.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

__all__ = ["SandboxResult", "run_untrusted", "landlock_abi"]

MEMORY_LIMIT_BYTES = 2 << 30
FILE_SIZE_LIMIT_BYTES = 1 << 20
OPEN_FILES_LIMIT = 256


@dataclass(frozen=True)
class SandboxResult:
    """``status``: ``passed``, ``failed`` or ``timeout``; ``stderr``: the program's last error lines;
    ``isolation``: what applied (``landlock``, ``landlock+net``, or ``rlimits``)."""

    status: str
    returncode: int | None
    stderr: str
    isolation: str


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0 when Landlock is unavailable)."""
    if not sys.platform.startswith("linux"):
        return 0
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    version = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # CREATE_RULESET_VERSION
    return max(0, int(version))


# The first lines of the program: limits, then Landlock (before any untrusted line runs).
_PRELUDE = r"""
import os as _os, resource as _r, sys as _s
_verdict_fd = int(_os.environ.pop("SANDBOX_VERDICT_FD"))
_r.setrlimit(_r.RLIMIT_AS, ({mem}, {mem}))
_r.setrlimit(_r.RLIMIT_CPU, ({cpu}, {cpu}))
_r.setrlimit(_r.RLIMIT_FSIZE, ({fsize}, {fsize}))
_r.setrlimit(_r.RLIMIT_NOFILE, ({nofile}, {nofile}))
_r.setrlimit(_r.RLIMIT_CORE, (0, 0))
def _landlock(work, read_only):
    import ctypes, struct
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        return "rlimits"
    refer, truncate, ioctl = (1 << 13) * (abi >= 2), (1 << 14) * (abi >= 3), (1 << 15) * (abi >= 5)
    fs = (1 << 13) - 1 | refer | truncate | ioctl
    net = 3 if abi >= 4 else 0  # BIND_TCP | CONNECT_TCP: handled, never allowed
    attr = struct.pack("QQ", fs, net) if abi >= 4 else struct.pack("Q", fs)
    ruleset = libc.syscall(444, attr, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        return "rlimits"
    read = (1 << 0) | (1 << 2) | (1 << 3)  # EXECUTE | READ_FILE | READ_DIR
    rules = [(p, read) for p in read_only] + [(work, fs), ("/dev/null", (1 << 1) | (1 << 2) | truncate)]
    for path, access in rules:
        try:
            fd = _os.open(path, _os.O_PATH | _os.O_CLOEXEC)
        except OSError:
            continue
        if not _os.path.isdir(path):
            access &= (1 << 0) | (1 << 1) | (1 << 2) | truncate | ioctl  # the rights a file can have
        rule = struct.pack("=Qi", access & fs, fd)
        libc.syscall(445, ctypes.c_int(ruleset), ctypes.c_int(1), rule, ctypes.c_uint32(0))
        _os.close(fd)
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.syscall(446, ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
        return "rlimits"
    return "landlock+net" if net else "landlock"
_isolation = _landlock(_os.getcwd(), {read_only!r})
_os.write(_verdict_fd, ("isolation " + _isolation + "\n").encode())
del _landlock, _isolation, _r
"""

# The supervisor: a child subreaper that runs the program, then leaves no process behind.
_SUPERVISOR = r"""
import json, os, signal, subprocess, sys, tempfile
if sys.platform.startswith("linux"):
    import ctypes
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
program, timeout, env = sys.stdin.read(), float(sys.argv[1]), json.loads(sys.argv[2])
read_end, write_end = os.pipe()
os.set_inheritable(write_end, True)
env["SANDBOX_VERDICT_FD"] = str(write_end)
errors = tempfile.TemporaryFile()  # a file, not a pipe: a left-behind child cannot hold the run open
child = subprocess.Popen([sys.executable, "-I", "-c", program], env=env, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=errors, pass_fds=(write_end,),
                         start_new_session=True)
os.close(write_end)
status = "failed"
try:
    child.wait(timeout=timeout)
except subprocess.TimeoutExpired:
    status = "timeout"
def descendants():
    me, out = str(os.getpid()), []
    for pid in filter(str.isdigit, os.listdir("/proc")) if os.path.isdir("/proc") else ():
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[1] == me:
                    out.append(int(pid))
        except (OSError, IndexError):
            pass
    return out
for _ in range(1000):  # the program's group, then every orphan reparented to this subreaper
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except OSError:
        pass
    pids = descendants()
    if not pids:
        break
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            if pid != child.pid:  # the program itself is reaped by child.wait(), keeping its status
                os.waitpid(pid, 0)
        except OSError:
            pass
    if pids == [child.pid]:
        child.wait()
child.wait()
errors.seek(0, 2)
errors.seek(max(0, errors.tell() - 2000))
err = errors.read()
report = os.read(read_end, 1 << 16).decode(errors="replace")
ok = report.rstrip().endswith("ok") and child.returncode == 0
isolation = next((ln.split()[1] for ln in report.splitlines() if ln.startswith("isolation ")), "rlimits")
verdict = "passed" if status != "timeout" and ok else status
stderr = (err or b"").decode(errors="replace")[-2000:]
out = {"status": verdict, "returncode": child.returncode, "stderr": stderr, "isolation": isolation}
print(json.dumps(out))
"""


def _read_only_paths() -> list[str]:
    """What the program may read: the interpreter's installation and the system's libraries."""
    paths = {sys.base_prefix, sys.prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))}
    paths |= {p for p in sys.path if p and os.path.isabs(p)}
    paths |= {"/usr", "/lib", "/lib64", "/lib32", "/etc", "/proc", "/dev", "/bin", "/sbin", "/opt"}
    return sorted(p for p in paths if os.path.exists(p))


def run_untrusted(program: str, *, timeout_s: float) -> SandboxResult:
    """Run ``program`` (Python source) as described in the module doc; it passes when it runs to its
    last line and exits 0 within ``timeout_s`` seconds."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    cpu = int(timeout_s) + 1
    prelude = _PRELUDE.format(
        mem=MEMORY_LIMIT_BYTES,
        cpu=cpu,
        fsize=FILE_SIZE_LIMIT_BYTES,
        nofile=OPEN_FILES_LIMIT,
        read_only=_read_only_paths(),
    )
    full = prelude + program + '\n_os.write(_verdict_fd, b"ok")\n'
    with tempfile.TemporaryDirectory(prefix="specdec-sandbox-") as workdir:
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": workdir,
            "TMPDIR": workdir,
            "LC_ALL": "C.UTF-8",
            "PYTHONHASHSEED": "0",
        }
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _SUPERVISOR, str(timeout_s), json.dumps(env)],
            cwd=workdir,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(full.encode(), timeout=timeout_s + 30)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            proc.communicate()
            return SandboxResult("timeout", None, "the supervisor outlived its deadline", "rlimits")
        finally:
            _kill_group(proc.pid)
    try:
        verdict = json.loads(out.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        return SandboxResult("failed", proc.returncode, err.decode(errors="replace")[-2000:], "rlimits")
    return SandboxResult(verdict["status"], verdict["returncode"], verdict["stderr"], verdict["isolation"])


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
