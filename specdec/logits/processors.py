"""One request's logits processors, applied at every position of a verify block with that position's
own prefix.

Legend: T positions of a block (chain: the root and each draft; tree: its nodes), V vocabulary.

A processor changes the target's distribution at a position as a function of the tokens before it:
penalties count them, ``min_tokens`` counts them, a grammar walks them. Speculative sampling keeps the
*processed* target distribution exactly (Leviathan et al. 2023, arXiv 2211.17192) only if every
position of a verify block is processed with its own prefix: the request's committed tokens **and the
draft tokens before it on its path**, never a neighbour's and never a rejected draft's. So the
processors here are functions of (prompt, output so far): :meth:`Processors.process` takes the logits
of T positions and each position's draft path (:meth:`Processors.process_draft` the same for a
drafter's logits at one draft position, so a drafter drafts from the processed distribution), and
:meth:`Processors.commit` moves the committed state forward by the tokens the rule kept (rejected
drafts never enter it: nothing to roll back). Greedy rows take the processed argmax; sampled rows the
processed distribution, warped by temperature, top-k, top-p and min-p
(:func:`specdec.sampling.sampling_probs`).

The order (transformers' and vLLM's up to where they differ): repetition, frequency and presence
penalties on the raw logits, then ``logit_bias`` (−100 bans), then ``min_tokens`` (the request's
end-of-sequence tokens banned while the output is shorter), then the grammar's mask
(:mod:`specdec.logits.grammar`), then each of the request's own processors (:data:`LogitsProcessor`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from specdec.logits.checks import BAN
from specdec.sampling import SamplingParams

__all__ = ["SAMPLING_CONTROLS", "LogitsProcessor", "Processors"]

SAMPLING_CONTROLS = (
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "logits_processors",
    "grammar",
)
"""The keywords of :meth:`specdec.Engine.add_request` that set a request's sampling controls (None or
absent: off); :func:`specdec.generate` takes the same for every row."""

LogitsProcessor = Callable[[Sequence[int], Sequence[int], torch.Tensor], torch.Tensor]
"""A request's own processor: ``fn(prompt_ids, output_ids, logits_V) -> logits_V`` (vLLM's per-request
form), a pure function of the prompt and the tokens generated before the position: it is called once
per verify position with that position's output so far (committed tokens, then the drafts before it),
so it must not keep state between calls. Its ``logits_V`` are float32; −inf bans a token."""


class Processors:
    """The processors of one request over its committed output: built by :meth:`build` (None when the
    request sets none), applied by :meth:`process`, moved forward by :meth:`commit`."""

    def __init__(
        self,
        sampling: SamplingParams,
        prompt_ids: Sequence[int],
        *,
        vocab_size: int,
        stop_ids: Sequence[int] = (),
        custom: Sequence[LogitsProcessor] = (),
        grammar: Any = None,
    ) -> None:
        self.sampling, self.prompt_ids, self.vocab_size = sampling, list(prompt_ids), vocab_size
        self.stop_ids = sorted(set(stop_ids))
        self.custom, self.grammar = list(custom), grammar
        self.output: list[int] = []
        # The penalties' state: the columns they touch (the repetition penalty's prompt tokens, then each
        # generated token as it first comes), each column's count in the output, whether it is in the prompt.
        self._columns: dict[int, int] = {}
        self._counts: list[float] = []
        self._in_prompt: list[bool] = []
        self._tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if sampling.repetition_penalty != 1.0:
            for token in dict.fromkeys(self.prompt_ids):
                self._column(int(token), in_prompt=True)
        bias = sampling.logit_bias
        for token, _ in bias:
            if token >= vocab_size:
                raise ValueError(f"logit_bias: token id {token} is not in the vocabulary (size {vocab_size})")
        self.bias_ids = torch.tensor([t for t, b in bias if b > BAN], dtype=torch.long)
        self.bias_values = torch.tensor([b for t, b in bias if b > BAN], dtype=torch.float32)
        self.banned_ids = torch.tensor([t for t, b in bias if b <= BAN], dtype=torch.long)

    @classmethod
    def build(cls, sampling: SamplingParams, prompt_ids: Sequence[int], **options: Any) -> Processors | None:
        """The request's processors (``options``: the constructor's keywords), or None when it sets
        none (its logits then go to the rule as they are: no cost)."""
        if not sampling.processes and not options.get("custom") and options.get("grammar") is None:
            return None
        return cls(sampling, prompt_ids, **options)

    # --- the committed state --------------------------------------------------------------------
    def commit(self, tokens: Sequence[int]) -> None:
        """The rule kept ``tokens`` (in order): they join the output the next positions see."""
        if not tokens:
            return
        for t in tokens:
            self.output.append(int(t))
            self._counts[self._column(int(t))] += 1
        self._tensors = None
        if self.grammar is not None:
            self.grammar.commit(tokens)

    @property
    def ended(self) -> str | None:
        """Why the request must end now (its grammar allows no further token), or None."""
        return None if self.grammar is None else self.grammar.ended

    # --- processing -----------------------------------------------------------------------------
    def process(
        self, logits_TV: torch.Tensor, paths: Sequence[Sequence[int]], *, inplace: bool = False
    ) -> torch.Tensor:
        """``logits_TV`` processed, position t with the committed output followed by ``paths[t]`` (the
        draft tokens between the last committed token and position t); float32. ``inplace``: the
        float32 ``logits_TV`` itself is changed and returned (else a new tensor)."""
        T, V = logits_TV.shape
        if len(paths) != T:
            raise ValueError(f"paths must give one draft path per position ({T}), got {len(paths)}")
        if inplace and logits_TV.dtype != torch.float32:
            raise ValueError(f"inplace processing needs float32 logits, got {logits_TV.dtype}")
        x = logits_TV if inplace else logits_TV.float().clone()
        s = self.sampling
        device = x.device
        if s.repetition_penalty != 1.0 or s.frequency_penalty or s.presence_penalty:
            self._penalise(x, paths)
        if len(self.bias_ids):
            x[:, self.bias_ids.to(device)] += self.bias_values.to(device)
        if len(self.banned_ids):
            x[:, self.banned_ids.to(device)] = float("-inf")
        if s.min_tokens and self.stop_ids:
            short = [t for t, p in enumerate(paths) if len(self.output) + len(p) < s.min_tokens]
            if short:
                rows = torch.tensor(short, device=device).unsqueeze(1)
                x[rows, torch.tensor(self.stop_ids, device=device)] = float("-inf")
        if self.grammar is not None:
            self.grammar.mask(x, paths)
        for fn in self.custom:
            for t, path in enumerate(paths):
                row = fn(self.prompt_ids, self.output + list(path), x[t])
                if not isinstance(row, torch.Tensor) or row.shape != (V,):
                    raise ValueError(
                        f"a logits processor must return a tensor of shape ({V},), got "
                        f"{getattr(row, 'shape', type(row).__name__)}"
                    )
                x[t] = row.to(device=device, dtype=torch.float32)
        return x

    def process_draft(
        self, logits_N: torch.Tensor, path: Sequence[int], vocab_N: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """A drafter's logits at one draft position, processed as the target's are at that position
        (the committed output, then ``path``: the drafts before it); float32. ``vocab_N``: the token ids
        of a draft vocabulary (an EAGLE head's), the logits' columns: they are placed in the full
        vocabulary (−inf elsewhere), processed, and read back. None where the processors allow none of
        the drafter's tokens there (the row stops drafting)."""
        if vocab_N is None:
            processed_N = self.process(logits_N.unsqueeze(0), [path])[0]
        else:
            vocab_N = vocab_N.to(logits_N.device)
            full_1V = logits_N.new_full((1, self.vocab_size), float("-inf"), dtype=torch.float32)
            full_1V[0, vocab_N] = logits_N.float()
            processed_N = self.process(full_1V, [path], inplace=True)[0, vocab_N]
        return None if bool(torch.isinf(processed_N).all()) else processed_N

    def _column(self, token: int, *, in_prompt: bool = False) -> int:
        """The penalties' column of ``token`` (added with count 0 where it has none)."""
        j = self._columns.get(token)
        if j is None:
            j = self._columns[token] = len(self._counts)
            self._counts.append(0.0)
            self._in_prompt.append(in_prompt)
        return j

    def _penalise(self, x_TV: torch.Tensor, paths: Sequence[Sequence[int]]) -> None:
        """The penalties, in place, on the columns they touch: the tokens generated so far and on the
        paths, and the prompt's tokens for the repetition penalty (``[T, n]`` work, n those tokens)."""
        s = self.sampling
        if self._tensors is None:
            self._tensors = (
                torch.tensor(list(self._columns), dtype=torch.long),
                torch.tensor(self._counts, dtype=torch.float32),
                torch.tensor(self._in_prompt, dtype=torch.bool),
            )
        cols_n, counts_n, prompt_n = self._tensors
        extra = [int(t) for p in paths for t in p if int(t) not in self._columns]
        extra = list(dict.fromkeys(extra))  # path tokens not generated before: columns of this call only
        if extra:
            cols_n = torch.cat([cols_n, torch.tensor(extra, dtype=torch.long)])
            counts_n = torch.cat([counts_n, torch.zeros(len(extra))])
            prompt_n = torch.cat([prompt_n, torch.zeros(len(extra), dtype=torch.bool)])
        if not len(cols_n):
            return
        counts_Tn = counts_n.expand(len(paths), -1).clone()
        rows = [t for t, p in enumerate(paths) for _ in p]
        if rows:
            local = {token: len(self._columns) + k for k, token in enumerate(extra)}
            at = [self._columns.get(int(token), local.get(int(token))) for p in paths for token in p]
            counts_Tn.index_put_(
                (torch.tensor(rows), torch.tensor(at)), torch.ones(len(rows)), accumulate=True
            )
        device = x_TV.device
        cols_n, counts_Tn = cols_n.to(device), counts_Tn.to(device)
        sub_Tn = x_TV[:, cols_n]
        if s.repetition_penalty != 1.0:
            seen_Tn = (counts_Tn > 0) | prompt_n.to(device)
            r = s.repetition_penalty
            sub_Tn = torch.where(seen_Tn, torch.where(sub_Tn > 0, sub_Tn / r, sub_Tn * r), sub_Tn)
        if s.frequency_penalty:
            sub_Tn -= s.frequency_penalty * counts_Tn
        if s.presence_penalty:
            sub_Tn -= s.presence_penalty * (counts_Tn > 0).float()
        x_TV[:, cols_n] = sub_Tn
