"""The one interleaved runner: every method on the same prompts, side by side, in one process.

``specdec bench`` and the decoding experiments (``experiments/catalog``) both run several methods
(our engine with a drafter, ``transformers``' ``generate``, a peer such as llama.cpp) on the
same prompts and report ratios. :func:`run_interleaved` runs each prompt through every method
before the next prompt starts, rotating the order per prompt, so slow drifts of a shared machine
hit all methods alike. :func:`time_interleaved` does the same for micro-benchmarks (one call per
repetition), the project's one timer: the CPU benchmarks (``specdec.bench.target``, the MoE and
packed and grouped GEMM benchmarks in ``experiments/``) time with it on the wall clock, the kernels'
GPU benchmark with :func:`cuda_clock` and an L2 flush before each call. A method is a callable
``(prompt, seed, max_new_tokens) -> PromptResult``; :func:`engine_method` makes one from an engine
with a drafter (:func:`method_engine`), driven as ``specdec bench --concurrency`` drives it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specdec.bench.report import PromptResult

__all__ = [
    "Prompt",
    "MethodFn",
    "run_interleaved",
    "time_interleaved",
    "wall_clock",
    "cuda_clock",
    "method_engine",
    "engine_method",
]


@dataclass
class Prompt:
    """One prompt of a prompt set (``set``), its index there, and its token ids."""

    set: str
    index: int
    ids: list[int]


MethodFn = Callable[[Prompt, int, int], PromptResult]
"""``(prompt, seed, max_new_tokens) -> PromptResult``."""


def run_interleaved(
    methods: Mapping[str, MethodFn],
    prompts: Sequence[Prompt],
    *,
    max_new_tokens: int,
    seed: int = 0,
    seed_by_position: bool = False,
    warmup: bool = True,
    baseline: str | None = None,
    on_result: Callable[[str, Prompt, PromptResult], None] | None = None,
    on_error: Callable[[str, Prompt, Exception], None] | None = None,
    on_prompt_done: Callable[[dict[str, list[PromptResult]]], None] | None = None,
) -> dict[str, list[PromptResult]]:
    """Run every method on every prompt, prompt-major, the order rotating per prompt.

    A prompt runs with seed ``seed + prompt.index`` for every method (``seed + i`` for the i-th
    prompt of ``prompts`` with ``seed_by_position``). ``warmup``: each method first
    decodes 8 untimed tokens of the first prompt (one-time costs: weight packing, allocator growth).
    A method that raises is dropped with all its results (partial results would compare unlike
    prompt sets) and ``on_error`` is told, unless it is ``baseline`` (the denominator of every
    ratio) or no ``on_error`` is given: then the error propagates. ``on_result`` sees every
    result; ``on_prompt_done`` sees the results so far after each prompt (to write them out, so an
    interrupted run keeps every finished prompt).
    """
    names = list(methods)
    results: dict[str, list[PromptResult]] = {name: [] for name in names}
    failed: set[str] = set()

    def attempt(name: str, i: int, prompt: Prompt, max_new: int) -> PromptResult | None:
        try:
            return methods[name](prompt, seed + (i if seed_by_position else prompt.index), max_new)
        except Exception as err:  # one broken method must not cost the others' results
            if on_error is None or name == baseline:
                raise
            failed.add(name)
            results.pop(name, None)
            on_error(name, prompt, err)
            return None

    if warmup and prompts:
        for name in names:
            attempt(name, 0, prompts[0], min(8, max_new_tokens))
    for i, prompt in enumerate(prompts):
        shift = i % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            if name in failed:
                continue
            result = attempt(name, i, prompt, max_new_tokens)
            if result is not None:
                results[name].append(result)
                if on_result is not None:
                    on_result(name, prompt, result)
        if on_prompt_done is not None:
            on_prompt_done(results)
    return results


def wall_clock(fn: Callable[[], object]) -> float:
    """Seconds of one call of ``fn`` on the wall clock."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def cuda_clock(fn: Callable[[], object]) -> float:
    """Seconds of one call of ``fn`` on the current CUDA stream: CUDA events recorded around it, read
    after a synchronize (host-side time between kernel launches counts, time before the first not)."""
    import torch

    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / 1e3


def time_interleaved(
    fns: Mapping[Any, Callable[[], object]],
    *,
    seconds: float = 0.0,
    min_reps: int = 5,
    max_reps: int = 300,
    warmup: int = 2,
    before: Callable[[], object] | None = None,
    clock: Callable[[Callable[[], object]], float] = wall_clock,
) -> dict[Any, list[float]]:
    """Times (s) of each callable, interleaved with a rotating order, after ``warmup`` untimed calls
    each (allocator, thread pool, lazy init, autotuning): at least ``min_reps`` and at most
    ``max_reps`` repetitions, stopping once ``seconds`` have passed (``min_reps == max_reps``: exactly
    that many). ``before`` runs untimed before every timed call (a GPU benchmark flushes the L2 cache
    there); ``clock`` times one call (:func:`wall_clock`, or :func:`cuda_clock` for GPU work)."""
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    times: dict[Any, list[float]] = {name: [] for name in names}
    start, rep = time.perf_counter(), 0
    while rep < max_reps and (rep < min_reps or time.perf_counter() - start < seconds):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            if before is not None:
                before()
            times[name].append(clock(fns[name]))
        rep += 1
    return times


def method_engine(
    target: Any,
    drafter: str,
    *,
    max_model_len: int,
    drafter_options: Mapping[str, Any] | None = None,
    gamma: Any = "auto",
    verify: Any = "exact",
    verify_options: Mapping[str, Any] | None = None,
) -> Any:
    """The engine a method runs its prompts through, one request at a time: the drafter built by its
    registered name (the object ``specdec generate`` and ``specdec serve`` run), built once for every
    prompt of the benchmark. ``max_model_len``: the longest prompt + new tokens + γ + 1 (raised to what
    the verify-cost grid of an adaptive depth policy needs: :func:`specdec.loop.model_len_for`)."""
    from specdec.engine import Engine
    from specdec.engine.depth import make_depth_policy
    from specdec.loop import model_len_for

    policy = make_depth_policy(gamma)
    model_len, measure_cost = model_len_for(target, max_model_len, policy)
    return Engine(
        target,
        drafter=drafter,
        drafter_options=drafter_options,
        gamma=policy,
        max_num_seqs=1,
        max_model_len=model_len,
        verify=verify,
        verify_options=verify_options,
        measure_cost=measure_cost,
    )


def engine_method(engine: Any, *, temperature: float, **request_options: Any) -> MethodFn:
    """A method that runs one prompt through ``engine`` (:func:`method_engine`) with
    :func:`specdec.loop.drive`, the driver of ``specdec generate`` and ``specdec bench --concurrency``;
    ``request_options``: :meth:`specdec.Engine.add_request`'s keywords (``stop_strings``, ...)."""
    from specdec.loop import drive

    def run(prompt: Prompt, seed: int, max_new_tokens: int) -> PromptResult:
        params = {"temperature": temperature, "max_new_tokens": max_new_tokens, **request_options}
        out = drive(engine, [prompt.ids], params, seeds=[seed])
        m = out.metrics
        return PromptResult(prompt.set, prompt.index, out.token_ids[0], m.total_time_s, m)

    return run
