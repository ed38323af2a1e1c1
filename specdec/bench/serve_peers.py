"""The servers ``specdec bench-serve`` starts: ours (``specdec serve``) and llama.cpp's ``llama-server``.

``--servers`` names them, run one after another on the same prompts:

- ``ours:DRAFTER``: ``python -m specdec serve --target TARGET --drafter DRAFTER --max-num-seqs SLOTS
  --threads THREADS --host 127.0.0.1 --port PORT``; ``ours:plain`` is ``ours:none`` whose requests carry
  ``"speculative": false`` (no drafts at all: a grammar's forced tokens are not drafted either);
- ``llama-server``: the binary at ``$LLAMA_SERVER``, else ``llama-server`` on ``PATH``, on the GGUF
  file the target comes as (:func:`specdec.targets.loading.gguf_source`, the file llama-bench gets):
  ``llama-server -m GGUF -t THREADS -np SLOTS -c SLOTS·CTX --host 127.0.0.1 --port PORT --metrics -a
  MODEL``, CTX a per-slot context that holds the longest prompt and ``max_tokens``. Its requests also
  carry ``"cache_prompt": false``, so that a prompt seen at an earlier level is prefilled again (our
  server keeps no prompt cache). Without a binary, or for a target that is not a GGUF file, the peer
  is skipped with a one-line reason.
- ``llama-server:MODE``: the same with llama.cpp's own speculation (:data:`LLAMA_MODES`):
  ``ngram-mod`` adds ``--spec-type ngram-mod`` (llama.cpp's n-gram defaults); ``eagle3`` adds
  ``--spec-type draft-eagle3 -md HEAD.gguf --spec-draft-n-max N --spec-draft-n-min 0
  --spec-draft-p-min 0 --spec-draft-threads THREADS``, HEAD.gguf our EAGLE-3 head converted for it
  (:mod:`specdec.bench.serve_heads`). Both report what they drafted and accepted, per response
  (``timings.draft_n``, ``timings.draft_n_accepted``) and in ``/metrics``.

Each is started on a free loopback port, waited for until ``GET /health`` answers 200, and stopped
with SIGTERM afterwards (SIGKILL if it has not exited within the timeout); its output goes to a log
file, whose last lines come with any failure.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "LLAMA_SERVER_ENV",
    "LLAMA_MODES",
    "PEERS",
    "ServerSpec",
    "LaunchedServer",
    "parse_servers",
    "find_llama_server",
    "llama_server_skipped",
    "free_port",
    "context_per_slot",
    "ours_command",
    "llama_server_command",
    "llama_speculation_args",
    "launch",
]

LLAMA_SERVER_ENV = "LLAMA_SERVER"
"""The environment variable naming llama-server's binary (it wins over ``PATH``)."""
LLAMA_MODES = {"ngram-mod": "ngram-mod", "eagle3": "draft-eagle3"}
"""``llama-server:MODE`` → the ``--spec-type`` llama-server runs it with (``tools/server``,
``common/speculative.cpp`` of llama.cpp)."""
PEERS = ("llama-server", *(f"llama-server:{mode}" for mode in LLAMA_MODES))
"""Names ``--peers`` and ``--servers`` accept besides ``ours:DRAFTER``."""
REQUEST_EXTRAS = {"llama-server": {"cache_prompt": False}}
"""Fields added to every request of a server kind (module doc)."""


@dataclass(frozen=True, kw_only=True)
class ServerSpec:
    """A server to load: ``ours`` (with its drafter), ``llama-server`` (with its mode: None, or a key
    of :data:`LLAMA_MODES`), or ``url`` (``--base-url``)."""

    name: str
    kind: str
    drafter: str | None = None
    mode: str | None = None
    base_url: str | None = None
    request_extras: dict[str, Any] = field(default_factory=dict)
    """Fields added to every request to it, past its kind's :data:`REQUEST_EXTRAS`."""


def parse_servers(items: Sequence[str], flag: str = "--servers", *, ours: bool = True) -> list[ServerSpec]:
    """``["ours:none", "ours:default", "llama-server", "llama-server:eagle3"]`` → specs (``ours=False``:
    peers only, as ``--peers`` takes); anything else is a ``ValueError`` naming ``flag`` (an unknown
    ``llama-server:MODE`` lists the known modes)."""
    specs = []
    for item in items:
        item = item.strip()
        kind, colon, rest = item.partition(":")
        if ours and item == "ours:plain":
            specs.append(
                ServerSpec(name=item, kind="ours", drafter="none", request_extras={"speculative": False})
            )
        elif ours and kind == "ours" and colon and rest.strip():
            specs.append(ServerSpec(name=f"ours:{rest.strip()}", kind="ours", drafter=rest.strip()))
        elif kind == "llama-server" and colon:
            if rest not in LLAMA_MODES:
                raise ValueError(
                    f"{flag}: unknown llama-server mode {rest!r}; known: {', '.join(LLAMA_MODES)} "
                    "(plain llama-server: no mode)"
                )
            specs.append(ServerSpec(name=item, kind="llama-server", mode=rest))
        elif item == "llama-server":
            specs.append(ServerSpec(name=item, kind=item))
        else:
            expected = ("ours:DRAFTER or " if ours else "") + f"one of {', '.join(PEERS)}"
            raise ValueError(f"{flag}: expected {expected}, got {item!r}")
    return specs


def find_llama_server() -> Path | None:
    """``$LLAMA_SERVER`` when set, else ``llama-server`` on ``PATH``; None without one. A
    ``$LLAMA_SERVER`` that is not an executable file is a ``ValueError``."""
    named = os.environ.get(LLAMA_SERVER_ENV)
    if named:
        path = Path(named).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ValueError(
                f"${LLAMA_SERVER_ENV}={named!r} is not an executable file (expected llama-server)"
            )
        return path
    found = shutil.which("llama-server")
    return Path(found) if found else None


def llama_server_skipped(name: str, target: str) -> str | None:
    """Why the llama-server peer ``name`` cannot run (no binary, or a target that does not come as a
    GGUF file), or None."""
    from specdec.targets.loading import gguf_source

    if find_llama_server() is None:
        return (
            f"{name} skipped: no llama-server on PATH and ${LLAMA_SERVER_ENV} is not set "
            "(docs/serving.md shows how to build it)"
        )
    if gguf_source(target) is None:
        return f"{name} skipped: --target {target} does not come as a GGUF file"
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A port that nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def context_per_slot(prompts: Sequence[str], max_tokens: int, *, template_tokens: int = 64) -> int:
    """Cache positions one request needs at most, rounded up to 256: a byte-level BPE token holds at
    least one byte, so a prompt's UTF-8 length bounds its tokens; ``template_tokens`` leaves room for
    a chat template's tokens."""
    longest = max((len(p.encode("utf-8")) for p in prompts), default=0)
    need = longest + template_tokens + max_tokens + 16
    return -(-need // 256) * 256


def ours_command(
    drafter: str, *, target: str, threads: int | None, max_num_seqs: int, port: int, host: str = "127.0.0.1",
    gamma: str = "auto",
) -> list[str]:  # fmt: skip
    """The command that starts ``specdec serve`` for ``ours:DRAFTER`` (this Python's ``-m specdec``;
    ``threads`` None: torch's default)."""
    return [
        sys.executable, "-m", "specdec", "serve", "--target", target, "--drafter", drafter,
        "--max-num-seqs", str(max_num_seqs), *(["--threads", str(threads)] if threads else []),
        "--host", host, "--port", str(port), "--gamma", gamma, "--log-level", "warning",
    ]  # fmt: skip


def llama_speculation_args(
    mode: str | None, *, threads: int, head: Path | None = None, draft_max: int = 3
) -> list[str]:
    """llama-server's flags for ``llama-server:MODE`` (module doc): none for plain ``llama-server``;
    ``eagle3`` drafts ``draft_max`` tokens per step with the converted ``head`` (a ``ValueError``
    without one), on ``threads`` threads as the target."""
    if mode is None:
        return []
    if mode not in LLAMA_MODES:
        raise ValueError(f"unknown llama-server mode {mode!r}; known: {', '.join(LLAMA_MODES)}")
    args = ["--spec-type", LLAMA_MODES[mode]]
    if mode == "eagle3":
        if head is None:
            raise ValueError("llama-server:eagle3 needs the head converted to GGUF (-md HEAD.gguf)")
        args += [
            "-md", str(head), "--spec-draft-n-max", str(draft_max), "--spec-draft-n-min", "0",
            "--spec-draft-p-min", "0", "--spec-draft-threads", str(threads),
        ]  # fmt: skip
    return args


def llama_server_command(
    binary: Path, gguf: Path, *, threads: int, slots: int, ctx_per_slot: int, port: int, model: str,
    host: str = "127.0.0.1", speculation: Sequence[str] = (),
) -> list[str]:  # fmt: skip
    """The command that starts ``llama-server`` (module doc), ``speculation`` its mode's flags
    (:func:`llama_speculation_args`)."""
    return [
        str(binary), "-m", str(gguf), "-t", str(threads), "-np", str(slots), "-c", str(slots * ctx_per_slot),
        "--host", host, "--port", str(port), "--metrics", "-a", model, *speculation,
    ]  # fmt: skip


@dataclass
class LaunchedServer:
    """A server process this benchmark started."""

    name: str
    command: list[str]
    proc: subprocess.Popen
    base_url: str
    log: Path
    exit_status: int | None = field(default=None)

    def log_tail(self, lines: int = 15) -> str:
        """The last lines of its output, joined by `` | ``."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return " | ".join(line.strip() for line in text.splitlines()[-lines:] if line.strip())

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then wait up to ``timeout_s`` (SIGKILL after that); returns the exit status
        (negative: the signal that ended it)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.exit_status = self.proc.returncode
        return self.exit_status


def launch(
    name: str, command: list[str], log: Path, *, port: int, startup_timeout_s: float, env: Any = None
) -> LaunchedServer:
    """Start ``command`` (output to ``log``) and wait for ``GET /health`` on ``port``; a
    ``RuntimeError`` with the log's last lines if it exits or does not answer within
    ``startup_timeout_s`` (the process is stopped then)."""
    from specdec.bench.serve_probe import wait_healthy

    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = LaunchedServer(name, command, proc, f"http://127.0.0.1:{port}", log)
    try:
        healthy = wait_healthy(server.base_url, startup_timeout_s, alive=lambda: proc.poll() is None)
    except BaseException:
        server.stop(10)
        raise
    if not healthy:
        status = proc.poll()
        server.stop(10)
        why = (
            f"exited with status {status}"
            if status is not None
            else f"not healthy after {startup_timeout_s:g} s"
        )
        raise RuntimeError(f"{name} {why}; its log ({log}): {server.log_tail()}")
    return server
