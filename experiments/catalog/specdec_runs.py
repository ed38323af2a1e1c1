"""What the speculative-decoding experiments share: targets by name, prompt categories, interleaved timing.

Legend: B batch, T sequence length, V vocabulary.

Not an experiment itself. Their configs extend :class:`DecodeRunConfig` (a target on a device, a
temperature, a seed), the in-process ones through :class:`InterleavedRunConfig` (new tokens, the
count-based drafters' corpus, torch threads). ``leviathan-table3-analog``, ``speedup-table``,
``gamma-sweep`` and ``lossy-quality`` call :func:`run_interleaved` to run several *methods* (a
drafter, γ and verification rule) on the same prompts, prompt by prompt in turn (so drifting load
on a shared machine hits every method alike), and summarise them with
:func:`specdec.bench.report.summarize` (speedup over our plain decode measured in the same run, α, τ,
predicted speedup, exact-match rate of greedy outputs). The runner is ``specdec bench``'s own
(:func:`specdec.bench.interleave.run_interleaved`). Targets are ``smollm2-135m`` (or any
checkpoint) and ``tiny-random``, a random-init two-layer Llama with a byte tokenizer that the CI
smoke runs use (built once into the specdec cache; nothing is downloaded).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from experiments.config import validate_config
from specdec.bench.interleave import Prompt

__all__ = [
    "TINY_TARGET",
    "MTBENCH_CATEGORIES",
    "CATEGORIES",
    "open_target",
    "open_run_target",
    "check_placement",
    "DecodeRunConfig",
    "InterleavedRunConfig",
    "CHAT_TEMPLATE",
    "byte_tokenizer",
    "tiny_checkpoint",
    "drafter_unavailable",
    "available_drafters",
    "category_prompts",
    "encode",
    "prompt_runs",
    "drafter_options",
    "Method",
    "PLAIN",
    "drafter_method",
    "PromptRun",
    "run_interleaved",
    "run_methods",
    "run_on_prompts",
    "method_rows",
    "sequence_log_likelihood",
    "torch_threads",
]

TINY_TARGET = "tiny-random"
MTBENCH_CATEGORIES = (
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
)
CATEGORIES = ("humaneval", *(f"mtbench/{c}" for c in MTBENCH_CATEGORIES))
"""Prompt categories: HumanEval (code completion) and the eight MT-Bench question categories."""

_TINY_VERSION = "v1"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_TARGETS: dict[tuple[str, str, str | None], Any] = {}


# --- targets --------------------------------------------------------------------------------------


def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges: 256 byte tokens + 3 specials (EOS ``<|im_end|>`` = 258),
    with :data:`CHAT_TEMPLATE`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>")
    hf.chat_template = CHAT_TEMPLATE
    return hf


def tiny_checkpoint() -> Path:
    """A random-init 2-layer Llama (dim 64, 259-token byte-level tokenizer) in the specdec cache."""
    from specdec.targets.loading import cache_dir

    out = cache_dir() / f"experiments-tiny-random-{_TINY_VERSION}"
    if (out / "model.safetensors").is_file():
        return out
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = byte_tokenizer()
    config = LlamaConfig(
        vocab_size=259,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=257,
        eos_token_id=258,
        pad_token_id=258,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float().eval()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + ".tmp"))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if not (out / "model.safetensors").is_file():
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)  # atomic: a half-written checkpoint is never picked up
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def open_target(name: str, *, device: str = "cpu", dtype: str | None = None):
    """The target ``name`` (built-in name, checkpoint folder or ``tiny-random``) on ``device`` in
    ``dtype`` (None: the weights format's own), loaded once per process per placement
    (:func:`specdec.targets.open_target`: ``ValueError`` for a device torch cannot use here, such as
    ``cuda`` on a machine without one, or a combination the target does not run)."""
    key = (name, device, dtype)
    if key not in _TARGETS:
        from specdec.targets import open_target as load

        path = str(tiny_checkpoint()) if name == TINY_TARGET else name
        _TARGETS[key] = load(path, device=device, dtype=dtype)
    return _TARGETS[key]


def open_run_target(config: Any, ctx: Any):
    """:func:`open_target` for a run's ``config`` (its ``target``, ``device`` and ``dtype`` fields),
    recorded in the run's ``env.json`` (``ctx.record_target``): the device and dtype the run used."""
    target = open_target(config.target, device=config.device, dtype=config.dtype)
    ctx.record_target(target)
    return target


def check_placement(config: Any) -> None:
    """``ValueError`` naming the config's ``device`` when torch cannot parse it, or its ``dtype`` when it
    is not a name in :data:`specdec.targets.DTYPES`. Whether the device exists here (``cuda`` on a CPU
    machine) is checked when the run starts (``python -m experiments run``) and when it opens its
    target, so a GPU plan can still be listed (``--dry-run``) anywhere."""
    from specdec.targets import DTYPES

    cls = type(config).__name__
    try:
        torch.device(config.device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"{cls}.device must be a torch device such as 'cpu', 'cuda' or 'cuda:1', got {config.device!r}"
        ) from None
    if config.dtype is not None and config.dtype not in DTYPES:
        raise ValueError(f"{cls}.dtype must be one of {DTYPES} or None, got {config.dtype!r}")


@dataclass(frozen=True, kw_only=True)
class DecodeRunConfig:
    """What every decode-run config has: a target placed on a device, a temperature and a seed.

    Building one checks every field against its type (:func:`~experiments.config.validate_config`)
    and the placement (:func:`check_placement`); a subclass adds its fields and, after
    ``super().__post_init__()``, its own checks (:meth:`at_least` for lower bounds).
    """

    target: str = "smollm2-135m"
    """built-in name, checkpoint folder, or ``tiny-random`` (the CI smoke's random Llama)"""
    device: str = "cpu"
    """torch device the target (and any draft head or model, which follow it) runs on: cpu, cuda, cuda:1"""
    dtype: str | None = None
    """the target's compute dtype (float32, bfloat16, float16); None: its weights format's own"""
    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        validate_config(self)
        check_placement(self)

    def at_least(self, **lows: int) -> None:
        """``ValueError`` naming the first field below its lower bound (``gamma=1``: γ >= 1)."""
        for name, low in lows.items():
            if getattr(self, name) < low:
                raise ValueError(f"{type(self).__name__}.{name} must be >= {low}, got {getattr(self, name)}")


@dataclass(frozen=True, kw_only=True)
class InterleavedRunConfig(DecodeRunConfig):
    """A decode run in this process: its methods on the same prompts, in turn (:func:`run_methods`)."""

    max_new_tokens: int = 128
    lm_corpus_chars: int = 1_500_000
    """characters of text the count-based ``unigram`` and ``bigram`` drafters learn from"""
    num_threads: int = 1
    """torch intra-op threads (0: leave torch's setting; :func:`torch_threads`)"""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.at_least(max_new_tokens=2, num_threads=0)


def drafter_unavailable(name: str, target: str) -> str | None:
    """Why drafter ``name`` cannot run against ``target`` now (None when it can); cheap, loads nothing."""
    from specdec.registry import DRAFTERS

    if name not in DRAFTERS:
        return f"{name}: not registered"
    if DRAFTERS.resolve(name) in ("eagle", "eagle-tree", "ngram-eagle"):
        if target == TINY_TARGET:
            return f"{name}: trained for smollm2-135m only"
        from importlib import resources

        from specdec.drafters.eagle import DEFAULT_WEIGHTS

        if not (resources.files("specdec") / "weights" / DEFAULT_WEIGHTS).is_file():
            return f"{name}: pending, weights not shipped yet (specdec/weights/{DEFAULT_WEIGHTS})"
    return None


# --- prompts --------------------------------------------------------------------------------------


def _evenly(items: Sequence[Any], n: int) -> list[Any]:
    if n >= len(items):
        return list(items)
    return [items[(i * len(items)) // n] for i in range(n)]


def category_prompts(category: str, num_prompts: int) -> list[str]:
    """``num_prompts`` prompts of a category, evenly spaced: ``humaneval``, ``mtbench`` (all
    categories) or ``mtbench/<category>`` (first turns of that MT-Bench category)."""
    from specdec.prompt_sets import humaneval_prompts, mtbench_questions

    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if category == "humaneval":
        return _evenly(humaneval_prompts(), num_prompts)
    if category == "mtbench":
        return _evenly([q["turns"][0] for q in mtbench_questions()], num_prompts)
    name = category.removeprefix("mtbench/")
    if category.startswith("mtbench/") and name in MTBENCH_CATEGORIES:
        return _evenly([q["turns"][0] for q in mtbench_questions() if q["category"] == name], num_prompts)
    raise ValueError(
        f"unknown prompt category {category!r}; known: humaneval, mtbench, {', '.join(CATEGORIES[1:])}"
    )


def encode(target: Any, category: str, text: str, *, chat: bool) -> list[int]:
    """Token ids of a prompt: HumanEval raw (code completion); MT-Bench in the chat template if ``chat``."""
    from specdec.prompt_sets import encode_prompt

    return encode_prompt(target.tokenizer, text, chat=chat and category.startswith("mtbench"))


# --- running methods side by side -----------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Method:
    """One way of decoding: a drafter (``none`` = plain decoding), γ, a verification rule.

    ``label`` names it in results (``ours/none`` is the baseline of every speedup)."""

    label: str
    drafter: str = "none"
    gamma: int = 4
    drafter_options: Mapping[str, Any] = field(default_factory=dict)
    verify: str = "exact"
    verify_options: Mapping[str, Any] = field(default_factory=dict)


PLAIN = Method(label="ours/none", drafter="none", gamma=0)
"""Plain decoding through the same engine: the baseline of every speedup."""


PromptRun = Prompt
"""One prompt of a category (``set``), its index there, and its token ids."""


def run_interleaved(
    target: Any,
    prompts: Sequence[PromptRun],
    methods: Sequence[Method],
    *,
    temperature: float,
    max_new_tokens: int,
    seed: int,
    ctx: Any,
    warmup: bool = True,
    **request_options: Any,
) -> dict[str, list]:
    """Every method on every prompt through :func:`specdec.bench.interleave.run_interleaved`;
    returns ``{label: [PromptResult, ...]}``.

    Each method's engine is built once, its drafter by name
    (:func:`specdec.bench.interleave.method_engine`), and runs one prompt at a time. The i-th prompt
    uses seed ``seed + i`` for every method. Each generation is logged to ``ctx`` as one step.
    ``request_options`` go to every request (:meth:`specdec.Engine.add_request`: ``stop_strings``,
    ``ignore_eos``, ...).
    """
    from specdec.bench.interleave import engine_method, method_engine
    from specdec.bench.interleave import run_interleaved as run

    longest = max((len(p.ids) for p in prompts), default=1)
    fns = {
        m.label: engine_method(
            method_engine(
                target,
                m.drafter,
                drafter_options=dict(m.drafter_options),
                gamma=m.gamma,
                verify=m.verify,
                verify_options=dict(m.verify_options) or None,
                max_model_len=longest + max_new_tokens + m.gamma + 1,
            ),
            temperature=temperature,
            **request_options,
        )
        for m in methods
    }

    def log(label: str, prompt: Prompt, result: Any) -> None:
        m = result.metrics
        ctx.log(
            {
                "method": label,
                "prompt_set": prompt.set,
                "prompt": prompt.index,
                "num_tokens": len(result.token_ids),
                "time_s": m.total_time_s,
                "tokens_per_second": m.tokens_per_second,
                "acceptance_rate": m.acceptance_rate,
                "alpha_iid": m.alpha_iid,
                "mean_accepted_tokens": m.mean_accepted_tokens,
                "num_proposed": m.num_proposed,
                "num_accepted": m.num_accepted,
            }
        )

    return run(
        fns,
        prompts,
        max_new_tokens=max_new_tokens,
        seed=seed,
        seed_by_position=True,
        warmup=warmup,
        on_result=log,
    )


def run_methods(
    config: Any,
    target: Any,
    prompts: Sequence[PromptRun],
    methods: Sequence[Method],
    ctx: Any,
    **request_options: Any,
) -> tuple[dict[str, list], int]:
    """:func:`run_interleaved` with a config's ``temperature``, ``max_new_tokens``, ``seed`` and
    ``num_threads`` (warm-up except in smoke runs); returns the results and the thread count used."""
    with torch_threads(config.num_threads) as threads:
        results = run_interleaved(
            target,
            prompts,
            methods,
            temperature=config.temperature,
            max_new_tokens=config.max_new_tokens,
            seed=config.seed,
            ctx=ctx,
            warmup=not ctx.smoke,
            **request_options,
        )
    return results, threads


def run_on_prompts(
    config: Any, ctx: Any, prompt_sets: Sequence[str], methods: Sequence[Method]
) -> tuple[dict[str, list], int]:
    """:func:`run_methods` on the config's target (:func:`open_run_target`) over ``config.num_prompts``
    prompts of each of ``prompt_sets`` (``config.chat``: in the chat template)."""
    target = open_run_target(config, ctx)
    prompts = prompt_runs(target, prompt_sets, config.num_prompts, chat=config.chat)
    return run_methods(config, target, prompts, methods, ctx)


def method_rows(results: Mapping[str, list], temperature: float, prompt_sets: Sequence[str]) -> list[dict]:
    """Per (prompt set and ``all``, method): :func:`specdec.bench.report.summarize`'s row (speedup against
    ``ours/none`` when it ran, α, τ, predicted speedup, exact-match rate when greedy)."""
    from specdec.bench.report import summarize

    runs = [{"method": label, "temperature": temperature, "results": rs} for label, rs in results.items()]
    rows = summarize(runs, list(prompt_sets))
    for row in rows:  # JSON-friendly: drop the per-position list keys that tables do not show
        row["acceptance_histogram"] = [round(x, 6) for x in row.get("acceptance_histogram", [])]
    return rows


def sequence_log_likelihood(target: Any, prompt_ids: Sequence[int], generated_ids: Sequence[int]) -> float:
    """Σ log target(x_t | x_<t) over the generated tokens, under the target's raw distribution
    (temperature 1, no top-k/top-p): one forward over prompt + generation."""
    if not generated_ids:
        return 0.0
    tokens = list(prompt_ids) + list(generated_ids)
    tokens_1T = torch.tensor([tokens], dtype=torch.long, device=getattr(target, "device", "cpu"))
    P = len(prompt_ids)
    with torch.inference_mode():
        target.reset(1, len(tokens) + 1)
        positions_1N = torch.arange(P - 1, len(tokens) - 1, device=tokens_1T.device).unsqueeze(0)
        out = target.forward(
            tokens_1T, torch.zeros(1, dtype=torch.long, device=tokens_1T.device), logits_index_BN=positions_1N
        )
        logp_NV = torch.log_softmax(out.logits_BTV[0].double(), dim=-1)
        return float(logp_NV.gather(1, tokens_1T[0, P:].unsqueeze(1)).sum())


def drafter_options(drafter: str, *, lm_corpus_chars: int) -> dict[str, Any]:
    """Drafter options an experiment sets: the corpus size of the count-based ``unigram`` and ``bigram``."""
    return {"max_chars": lm_corpus_chars} if drafter in ("unigram", "bigram") else {}


def drafter_method(
    config: InterleavedRunConfig, drafter: str, gamma: int, *, label: str | None = None, **rule: Any
) -> Method:
    """``drafter`` at ``gamma`` with the options an experiment sets (:func:`drafter_options`), labelled
    ``ours/<drafter>`` unless ``label`` says otherwise; ``rule``: ``verify`` and ``verify_options``."""
    options = drafter_options(drafter, lm_corpus_chars=config.lm_corpus_chars)
    return Method(
        label=label or f"ours/{drafter}", drafter=drafter, gamma=gamma, drafter_options=options, **rule
    )


def available_drafters(names: Sequence[str], target: str) -> tuple[tuple[str, ...], list[str]]:
    """The drafters of ``names`` that can run against ``target`` now, and why each other one cannot
    (:func:`drafter_unavailable`)."""
    reasons = {d: drafter_unavailable(d, target) for d in names}
    return tuple(d for d, r in reasons.items() if r is None), [r for r in reasons.values() if r]


def prompt_runs(target: Any, categories: Sequence[str], num_prompts: int, *, chat: bool) -> list[PromptRun]:
    """``num_prompts`` prompts of each category, encoded for ``target``."""
    return [
        PromptRun(category, i, encode(target, category, text, chat=chat))
        for category in categories
        for i, text in enumerate(category_prompts(category, num_prompts))
    ]


@contextlib.contextmanager
def torch_threads(num_threads: int) -> Iterator[int]:
    """Run with ``num_threads`` torch intra-op threads (0: leave torch's setting); yields the count used.

    One thread is the robust choice on a shared machine: with two threads on two busy cores every
    parallel op waits for its slower thread (measured here: a SmolLM2 decode step took 25 ms with one
    thread and 1.7 s with two while other jobs ran). Ratios are measured within one run either way.
    """
    if num_threads < 0:
        raise ValueError(f"num_threads must be >= 0, got {num_threads}")
    before = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
