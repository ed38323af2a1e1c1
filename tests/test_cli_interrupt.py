"""Ctrl-C at any point of the command line, the heavy imports included: one line, exit status 130.

The entry points run in a subprocess with ``PYTHONPROFILEIMPORTTIME=1``, which writes a line to
stderr as each import finishes; SIGINT is sent once a submodule of torch has been imported, so it
lands inside ``import torch`` rather than at a random time. In process: a Ctrl-C that a library
swallows (then fails, or goes on) still ends the command as an interrupt.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import specdec.cli as cli
from specdec.cli_args import interrupt_watch

REPO = Path(__file__).resolve().parents[1]
CONSOLE_SCRIPT = Path(sys.executable).parent / "specdec"


# A command started from a terminal has SIGINT at its default; one started in the background of a
# shell inherits it ignored, and Python then installs no handler. Reset it before exec, so the command
# meets Ctrl-C as a user's would, whatever started the tests.
_AS_FROM_A_TERMINAL = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


def _interrupt_during_torch_import(argv: list[str]) -> tuple[int, list[str]]:
    """Run ``argv``, send SIGINT while it imports torch; its exit status and non-import stderr lines."""
    env = dict(os.environ, PYTHONPROFILEIMPORTTIME="1", PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-c", _AS_FROM_A_TERMINAL, *argv],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        lines = []
        deadline = time.monotonic() + 60
        for raw in proc.stderr:
            line = raw.decode(errors="replace")
            lines.append(line)
            if line.startswith("import time:") and line.rsplit("|", 1)[-1].strip().startswith("torch."):
                break  # a submodule of torch is imported: torch itself is still importing
            if time.monotonic() > deadline:
                pytest.fail("torch was never imported")
        else:
            pytest.fail(f"{argv} ended before importing torch: {''.join(lines)[-2000:]}")
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = [
        line for line in rest.decode(errors="replace").splitlines() if not line.startswith("import time:")
    ]
    return proc.returncode, text


def test_the_command_modules_import_neither_torch_nor_transformers():
    code = (
        "import sys, specdec, specdec.cli, specdec.cli_args, specdec.seeds, experiments\n"
        "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


CASES = {
    "console script": [str(CONSOLE_SCRIPT), "generate", "--prompt", "x", "--target", "/no/such/model"],
    "python -m specdec": [sys.executable, "-m", "specdec", "generate", "--prompt", "x"],
    "python -m experiments": [sys.executable, "-m", "experiments", "list"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_ctrl_c_during_the_imports_is_one_line_and_status_130(case):
    if case == "console script" and not CONSOLE_SCRIPT.exists():
        pytest.skip(f"the console script is not installed at {CONSOLE_SCRIPT}")
    status, err = _interrupt_during_torch_import(CASES[case])
    assert status == 130, err
    assert not any("Traceback" in line for line in err), "\n".join(err)
    assert len(err) == 1 and "interrupted" in err[0], err


@pytest.fixture
def default_sigint():
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT has a non-default handler in this process")


def test_interrupt_watch_remembers_a_swallowed_ctrl_c(default_sigint):
    with interrupt_watch() as interrupted:
        assert not interrupted()
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        assert interrupted()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def _swallow_ctrl_c() -> None:
    try:
        signal.raise_signal(signal.SIGINT)
    except KeyboardInterrupt:
        pass  # what a C extension does when it clears the error of a failed import


@pytest.mark.parametrize("then", ["fails", "finishes"])
def test_a_ctrl_c_swallowed_by_a_library_still_ends_the_command(then, default_sigint, monkeypatch, capsys):
    def command(args):
        _swallow_ctrl_c()
        if then == "fails":
            raise RuntimeError("numpy is half-imported")  # the later, unrelated error
        return 0

    monkeypatch.setattr(cli, "cmd_generate", command)
    assert cli.main(["generate", "--prompt", "x"]) == 130
    assert capsys.readouterr().err == "specdec: interrupted\n"


def test_without_ctrl_c_an_internal_error_keeps_its_traceback(monkeypatch):
    def command(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "cmd_generate", command)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["generate", "--prompt", "x"])
