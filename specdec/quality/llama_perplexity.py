"""llama.cpp's ``llama-perplexity``, run beside ``specdec perplexity`` on the same GGUF, text and ctx.

Legend: C chunk length (``ctx``), N scored positions of a chunk (C - C/2 - 1), V vocabulary.

:func:`run_llama_perplexity` finds the binary (``$LLAMA_PERPLEXITY``, else ``llama-perplexity`` on
``PATH``, as the benchmarks find ``llama-bench``), runs

    llama-perplexity -m GGUF -f TEXT -c CTX [--chunks K] -t THREADS [--kl-divergence-base FILE]

in a subprocess with a timeout, and parses its final estimate ``PPL = x +/- y``
(:func:`parse_llama_perplexity_output`). With ``--kl-divergence-base FILE`` llama.cpp also saves its
tokens and every scored position's log-probabilities (16-bit, over a 16-nat range below the
maximum): :func:`read_llama_logits` reads them back, and :class:`PeerComparison` compares them token
by token with ours (same tokens? the NLL difference, KL, top-1 agreement).

:func:`run_llama_tokenize` runs llama.cpp's ``llama-tokenize`` (``$LLAMA_TOKENIZE``, else beside
``llama-perplexity``, else on ``PATH``) on the same GGUF and text: the tokens ``llama-perplexity``
scores, whole, without its log-probabilities.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdec.bench.llama_bench import _build_options, _version, find_llama_tool
from specdec.quality.perplexity import Scores

__all__ = [
    "LLAMA_PERPLEXITY_ENV",
    "find_llama_perplexity",
    "parse_llama_perplexity_output",
    "run_llama_perplexity",
    "LLAMA_TOKENIZE_ENV",
    "find_llama_tokenize",
    "run_llama_tokenize",
    "LlamaLogits",
    "read_llama_logits",
    "PeerComparison",
]

LLAMA_PERPLEXITY_ENV = "LLAMA_PERPLEXITY"
"""The environment variable naming the binary (it wins over ``PATH``)."""

_FINAL = re.compile(r"Final estimate: PPL = ([0-9.eE+-]+|nan|inf) \+/- ([0-9.eE+-]+|nan|inf)")
_CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+), batch_size=(\d+), n_seq=(\d+)")
_TOO_SHORT = re.compile(r"tokenizes to only (\d+) tokens")
_SYSTEM = re.compile(r"system_info: (.*)$", re.MULTILINE)
_PASS = re.compile(r"([0-9.]+) seconds per pass")


def _run_tool(name: str, command: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run one of llama.cpp's tools with a timeout; ``ValueError`` (one line) where it cannot start or
    runs past the timeout (its exit status is the caller's to read)."""
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ValueError(f"{name} ran past its {timeout_s:g} s timeout: {' '.join(command)}") from None
    except OSError as err:
        raise ValueError(f"{name} did not start: {err}") from None


def find_llama_perplexity() -> Path | None:
    """The ``llama-perplexity`` binary: ``$LLAMA_PERPLEXITY`` when set, else on ``PATH``; None
    without one. A ``$LLAMA_PERPLEXITY`` that is not an executable file is a ``ValueError``."""
    return find_llama_tool("llama-perplexity", LLAMA_PERPLEXITY_ENV)


def parse_llama_perplexity_output(text: str, source: str = "llama-perplexity output") -> dict[str, Any]:
    """llama-perplexity's console output → ``{"ppl", "ppl_stderr", "n_chunks", "ctx", "batch_size",
    "n_seq", "seconds_per_pass", "system_info"}``; ``ValueError`` naming ``source`` where it holds no
    final estimate (the text too short for one chunk is said as such)."""
    final = _FINAL.search(text)
    if final is None:
        short = _TOO_SHORT.search(text)
        if short:
            raise ValueError(f"{source}: the text tokenizes to only {short.group(1)} tokens for llama.cpp")
        tail = " ".join(text.split()[-30:])
        raise ValueError(f"{source}: no 'Final estimate: PPL = x +/- y' line (ends: {tail!r})")
    out: dict[str, Any] = {"ppl": float(final.group(1)), "ppl_stderr": float(final.group(2))}
    chunks = _CHUNKS.search(text)
    if chunks:
        out |= dict(zip(("n_chunks", "ctx", "batch_size", "n_seq"), map(int, chunks.groups()), strict=True))
    passes = _PASS.search(text)
    out["seconds_per_pass"] = float(passes.group(1)) if passes else None
    system = _SYSTEM.search(text)
    out["system_info"] = system.group(1).strip() if system else None
    return out


def run_llama_perplexity(
    gguf: Path | None,
    text_file: Path,
    *,
    ctx: int,
    chunks: int | None = None,
    threads: int = 1,
    logits_file: Path | None = None,
    extra_args: Sequence[str] = (),
    timeout_s: float = 3600.0,
) -> dict[str, Any]:
    """Run ``llama-perplexity`` on ``gguf`` and ``text_file`` (``extra_args`` appended, e.g.
    ``--no-repack``); its parsed estimate with ``binary``, ``command``, ``version`` and
    ``build_options``. ``ValueError`` (one line) where it cannot run: no GGUF file, no binary, a
    timeout, a failure, or output without a final estimate."""
    if gguf is None:
        raise ValueError("--peers llama.cpp needs a target that comes as a GGUF file")
    binary = find_llama_perplexity()
    if binary is None:
        raise ValueError(
            f"--peers llama.cpp: no llama-perplexity on PATH and ${LLAMA_PERPLEXITY_ENV} is not set "
            "(build llama.cpp's tools: docs/quality.md)"
        )
    command = [str(binary), "-m", str(gguf), "-f", str(text_file), "-c", str(ctx), "-t", str(threads)]
    if chunks is not None:
        command += ["--chunks", str(chunks)]
    if logits_file is not None:
        command += ["--kl-divergence-base", str(logits_file)]
    command += list(extra_args)
    done = _run_tool("llama-perplexity", command, timeout_s)
    output = done.stdout + done.stderr
    if done.returncode != 0:
        tail = " ".join(output.split()[-40:])
        raise ValueError(f"llama-perplexity failed: exit status {done.returncode}: {tail}")
    figures = parse_llama_perplexity_output(output, source=f"{binary} output")
    return {
        "binary": str(binary),
        "command": " ".join(command),
        "version": _version(binary),
        "build_options": _build_options(binary),
        **figures,
    }


LLAMA_TOKENIZE_ENV = "LLAMA_TOKENIZE"
"""The environment variable naming ``llama-tokenize`` (it wins over the one beside ``llama-perplexity``)."""

_ESCAPE_FLAGS = {"-e": "--escape", "--escape": "--escape", "--no-escape": "--no-escape"}
"""The arguments that say whether a tool reads escape sequences in the text (a backslash and ``n``
as a newline, ...): ``llama-perplexity`` does not unless given ``-e``; ``llama-tokenize`` does unless
given ``--no-escape``."""


def find_llama_tokenize(beside: Path | None = None) -> Path | None:
    """The ``llama-tokenize`` binary: ``$LLAMA_TOKENIZE`` when set, else the one in ``beside``'s
    folder (the ``llama-perplexity`` of the same build), else on ``PATH``; None without one."""
    if beside is not None and not os.environ.get(LLAMA_TOKENIZE_ENV):
        sibling = Path(beside).parent / "llama-tokenize"
        if sibling.is_file() and os.access(sibling, os.X_OK):
            return sibling
    return find_llama_tool("llama-tokenize", LLAMA_TOKENIZE_ENV)


def run_llama_tokenize(
    binary: Path,
    gguf: Path,
    text_file: Path,
    *,
    perplexity_args: Sequence[str] = (),
    timeout_s: float = 600.0,
) -> list[int]:
    """``llama-tokenize -m GGUF -f TEXT --ids``: llama.cpp's tokens of the file as it is (so give it
    the text ``llama-perplexity -f`` reads: one trailing newline dropped), with its special tokens,
    reading escape sequences in it where ``perplexity_args`` make ``llama-perplexity`` read them
    (its last ``-e`` / ``--escape`` / ``--no-escape``; by default it does not); ``ValueError`` (one
    line) where it fails."""
    escape = next((_ESCAPE_FLAGS[a] for a in reversed(perplexity_args) if a in _ESCAPE_FLAGS), "--no-escape")
    command = [str(binary), "-m", str(gguf), "-f", str(text_file), "--ids", escape]
    done = _run_tool("llama-tokenize", command, timeout_s)
    lines = [line for line in done.stdout.splitlines() if line.startswith("[") and line.endswith("]")]
    if done.returncode != 0 or not lines:
        tail = " ".join((done.stdout + done.stderr).split()[-40:])
        raise ValueError(f"llama-tokenize failed: exit status {done.returncode}: {tail}")
    ids = json.loads(lines[-1])
    if not all(isinstance(t, int) for t in ids):
        raise ValueError(f"llama-tokenize printed something other than token ids: {lines[-1][:80]}")
    return ids


@dataclass
class LlamaLogits:
    """What ``llama-perplexity --kl-divergence-base FILE`` saved: ``ctx``, ``n_vocab``, ``n_chunks``,
    the evaluated ``tokens`` (``[n_chunks * ctx]``, before any BOS replacement) and, per chunk,
    the scored positions' 16-bit log-probabilities (:meth:`chunk_logprobs`)."""

    path: Path
    ctx: int
    n_vocab: int
    n_chunks: int
    tokens: np.ndarray
    _data: np.ndarray

    def chunk_logprobs(self, i: int) -> torch.Tensor:
        """``[N, V]`` float32: chunk ``i``'s log-probabilities as llama.cpp stored them
        (``scale * q + min_log_prob``; a value at the bottom of the 16-nat range stands for any below)."""
        if not 0 <= i < self.n_chunks:
            raise ValueError(f"chunk must be in [0, {self.n_chunks}), got {i}")
        n = self.ctx - 1 - self.ctx // 2
        rows = self._data[i * n : (i + 1) * n]
        head = np.ascontiguousarray(rows[:, :4]).view(np.float32)  # [N, 2]: scale, min_log_prob
        q = torch.from_numpy(rows[:, 4 : 4 + self.n_vocab].astype(np.float32))
        return torch.from_numpy(head[:, :1].copy()) * q + torch.from_numpy(head[:, 1:2].copy())

    def chunks(self) -> Iterator[torch.Tensor]:
        """Every chunk's :meth:`chunk_logprobs`, in order."""
        for i in range(self.n_chunks):
            yield self.chunk_logprobs(i)


def read_llama_logits(path: Path) -> LlamaLogits:
    """Read a ``--kl-divergence-base`` file (``_logits_``, ctx, n_vocab, n_chunks as 32-bit ints,
    the tokens, then per chunk N rows of ``2 * ((V + 1) // 2) + 4`` uint16: two float32, scale and
    minimum log-prob, then V quantised log-probs); ``ValueError`` for another file or a short one."""
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    if raw.size < 20 or bytes(raw[:8]) != b"_logits_":
        raise ValueError(f"{path}: not a llama-perplexity log-probability file (no '_logits_' header)")
    ctx, n_vocab, n_chunks = (int(x) for x in np.frombuffer(bytes(raw[8:20]), dtype=np.int32))
    if ctx < 4 or n_vocab < 1 or n_chunks < 1:
        raise ValueError(f"{path}: bad header (ctx {ctx}, n_vocab {n_vocab}, n_chunks {n_chunks})")
    tokens_end = 20 + 4 * ctx * n_chunks
    nv = 2 * ((n_vocab + 1) // 2) + 4
    n = ctx - 1 - ctx // 2
    need = tokens_end + 2 * nv * n * n_chunks
    if raw.size < need:
        raise ValueError(f"{path}: {raw.size} bytes, expected {need} for {n_chunks} chunks of ctx {ctx}")
    tokens = np.frombuffer(bytes(raw[20:tokens_end]), dtype=np.int32)
    data = np.memmap(path, dtype=np.uint16, mode="r", offset=tokens_end, shape=(n * n_chunks, nv))
    return LlamaLogits(path, ctx, n_vocab, n_chunks, tokens, data)


@dataclass
class PeerComparison:
    """Ours against llama.cpp's saved log-probabilities, token by token, per set of our weights.

    Where a chunk's tokens differ from llama.cpp's, only the count is kept (the positions do not
    line up); on equal chunks, per scored token: our NLL minus llama.cpp's, KL(llama.cpp ‖ ours)
    over llama.cpp's tokens above log p = -16 (as its ``--kl-divergence`` sums), and top-1 agreement."""

    peer: LlamaLogits
    chunk_tokens_NC: torch.Tensor
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)

    def tokens_report(self) -> dict[str, Any]:
        """How many of the evaluated tokens equal llama.cpp's, and the first that differs."""
        n = min(self.peer.n_chunks, len(self.chunk_tokens_NC))
        ours = self.chunk_tokens_NC[:n].reshape(-1).numpy()
        theirs = self.peer.tokens[: ours.size]
        same = ours == theirs
        same[:: self.peer.ctx] = True  # the first token of a chunk may be replaced by BOS on either side
        diff = np.flatnonzero(~same)
        return {
            "compared": int(ours.size),
            "different": int(diff.size),
            "first_different": int(diff[0]) if diff.size else None,
        }

    def observe(self, chunk: int, name: str, scores: Scores) -> None:
        """Compare our scores of chunk ``chunk`` under weights ``name`` with llama.cpp's."""
        s = self.stats.setdefault(name, {"chunks": 0, "skipped": 0, "dnll": [], "kld": [], "same_top": 0})
        ctx = self.peer.ctx
        if chunk >= self.peer.n_chunks:
            s["skipped"] += 1
            return
        theirs_C = torch.from_numpy(self.peer.tokens[chunk * ctx : (chunk + 1) * ctx].astype(np.int64))
        if not torch.equal(theirs_C[1:], self.chunk_tokens_NC[chunk][1:]):
            s["skipped"] += 1
            return
        base_NV = self.peer.chunk_logprobs(chunk)
        first = ctx // 2
        nll_base_N = -base_NV.gather(-1, theirs_C[first + 1 :, None])[:, 0].double()
        s["dnll"].append(scores.nll_N - nll_base_N)
        base = base_NV.double()
        terms_NV = base.exp() * (base - scores.logprobs_NV.double())
        s["kld"].append(torch.where(base_NV > -16.0, terms_NV, torch.zeros_like(terms_NV)).sum(dim=-1))
        s["same_top"] += int((base_NV.argmax(dim=-1) == scores.top1_N).sum())
        s["chunks"] += 1

    def result(self) -> dict[str, Any]:
        """``tokens`` (:meth:`tokens_report`) and per weights: chunks compared and skipped, the mean
        and mean absolute NLL difference (ours - llama.cpp), mean and max KL, top-1 agreement."""
        out: dict[str, Any] = {"tokens": self.tokens_report(), "weights": {}}
        for name, s in self.stats.items():
            row: dict[str, Any] = {"chunks": s["chunks"], "skipped_chunks": s["skipped"]}
            if s["dnll"]:
                dnll, kld = torch.cat(s["dnll"]), torch.cat(s["kld"])
                row |= {
                    "dnll_mean": float(dnll.mean()),
                    "dnll_abs_mean": float(dnll.abs().mean()),
                    "dnll_abs_max": float(dnll.abs().max()),
                    "kld_mean": float(kld.mean()),
                    "kld_max": float(kld.max()),
                    "top1_agree": s["same_top"] / dnll.numel(),
                }
            out["weights"][name] = row
        return out
