"""The verdicts of a step's units: their logits checked, the rule's call, one read to the host.

Legend: G rows of a unit, T block length, V vocabulary.

A :class:`Part` is a verify unit with its slice of the forward's output and its rows' start
positions. :class:`Judge` gives every part its verdict by the rule, where the logits are, with the
rows' keyed noise; the logits are checked (on the host now, or on a device with the step's one read,
:mod:`specdec.engine.transfer`) and the verdicts come to the host in that one read. A row whose logits
or proposal fail their check, or whose own rule call raises, fails alone (:mod:`specdec.engine.faults`):
:func:`rows_alone` makes a call over a part again for each of its rows where the call raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from specdec.checks import check_logits, logits_faults
from specdec.engine.faults import each_alone
from specdec.engine.processing import processed_logits
from specdec.engine.transfer import HostTransfer
from specdec.engine.units import Unit
from specdec.host_sync import avoids_host
from specdec.protocols import TargetOutput
from specdec.verify.blocks import ChainBlock, Verdict
from specdec.verify.contract import VerifyRule
from specdec.verify.noise import PositionNoise

__all__ = ["Fail", "Judge", "Part", "rows_alone"]

Fail = Callable[[Any, str, Exception], None]
"""``fail(request, where, error)``: the request fails alone (``Runner.fail`` with the step's report)."""


def _verdict_rows(verdict: Verdict, index: list[int]) -> Verdict:
    path = verdict.path_BA
    return Verdict(
        verdict.tokens_BA[index], verdict.num_accepted_B[index], None if path is None else path[index]
    )


class Part:
    """A unit with its slice of the verify forward's output and its rows' start positions; once
    judged, its verdict."""

    def __init__(self, unit: Unit, out: TargetOutput, start_G: torch.Tensor) -> None:
        self.unit, self.out, self.start_G = unit, out, start_G
        self.verdict: Verdict | None = None

    def select(self, index: list[int]) -> Part:
        """Rows ``index`` of the part (in that order), with their rows of its verdict."""
        part = Part(self.unit.select(index), self.out.select(index), self.start_G[index])
        if self.verdict is not None:
            part.verdict = _verdict_rows(self.verdict, index)
        return part


def rows_alone(part: Part, call: Callable[[Part], Any], where: str, fail: Fail) -> list[tuple[Part, Any]]:
    """``call`` over the whole part; where it raises, over each of its rows alone, and a row whose own
    call raises fails (:func:`specdec.engine.faults.each_alone`). Returns (part, result) pairs."""
    whole = list(range(part.unit.size))
    sub = lambda index: part if len(index) == len(whole) else part.select(index)  # noqa: E731
    fail_row = lambda i, err: fail(part.unit.rows[i], where, err)  # noqa: E731
    return [(sub(index), result) for index, result in each_alone(whole, lambda i: call(sub(i)), fail_row)]


class Judge:
    """Verdicts by ``rule``; its seconds go to ``stats["rule_s"]`` on the clock ``now``."""

    def __init__(self, rule: VerifyRule, stats: dict[str, float], now: Callable[[], float]) -> None:
        self.rule, self.stats, self.now = rule, stats, now

    def __call__(self, parts: list[Part], step: int | str, fail: Fail) -> list[Part]:
        """Every part's verdict by the rule on the target's device, its logits checked, read to the
        host in one copy with the checks' faults; returns the parts whose rows go on."""
        if not parts:
            return []
        transfer = HostTransfer(parts[0].out.logits_BTV.device)
        judged: list[Part] = []
        t_rule = self.now()
        for part in parts:
            on_device = avoids_host(part.out.logits_BTV)
            pieces = [part]
            if not on_device:
                pieces = [p for p, _ in rows_alone(part, self._checks(step), "the target's logits", fail)]
            for piece in pieces:
                for done, verdict in rows_alone(piece, self.verdict, "the verification rule", fail):
                    i = len(judged)
                    judged.append(done)
                    for name, value in zip(("tokens", "accepted", "path"), verdict, strict=True):
                        if value is not None:
                            transfer.add(f"{name}{i}", value)
                    faults = [] if done.unit.fault is None else [done.unit.fault]
                    if on_device:
                        faults.append(logits_faults(done.out.logits_BTV))
                    if faults:
                        transfer.add(f"fault{i}", torch.stack([f.to(transfer.device) for f in faults]).any())
        fetched = transfer.fetch() if judged else {}  # the step's one read
        self.stats["rule_s"] += self.now() - t_rule
        kept: list[Part] = []
        for i, part in enumerate(judged):
            path = fetched.get(f"path{i}")
            part.verdict = Verdict(
                torch.from_numpy(fetched[f"tokens{i}"]),
                torch.from_numpy(fetched[f"accepted{i}"]),
                None if path is None else torch.from_numpy(path),
            )
            fault = fetched.get(f"fault{i}")
            kept += [part] if fault is None or not bool(fault) else self._recheck(part, step, fail)
        return kept

    @staticmethod
    def _checks(step: int | str) -> Callable[[Part], None]:
        """The host's checks of a part: its logits, and each row's own check where the unit has one
        (a proposal checked on the device, a prefill chunk's logits)."""

        def check(p: Part) -> None:
            check_logits(p.out.logits_BTV, step=step, source="the target")
            for i in range(p.unit.size if p.unit.recheck is not None else 0):
                p.unit.recheck(i)

        return check

    def _recheck(self, part: Part, step: int | str, fail: Fail) -> list[Part]:
        """A part whose device-side check found a fault: its rows checked on the host; the rows that
        fail their checks fail, the others go on with their verdicts."""
        ok = rows_alone(part, self._checks(step), "the step's checks", fail)
        if ok and ok[0][0] is part:  # the host's checks pass where the device's found a fault
            err = ValueError(
                "a device-side check of the target's logits or a proposal failed, the host's passed"
            )
            for r in part.unit.rows:
                fail(r, "the step's checks", err)
            return []
        return [p for p, _ in ok]

    def verdict(self, part: Part) -> Verdict:
        """One part's verdict by the rule, where the logits are, on its rows' processed logits
        (:mod:`specdec.engine.processing`), with the rows' keyed noise and the output-stream index of
        the token each block position decides (docs/randomness.md)."""
        unit, start_G = part.unit, part.start_G
        rows, block = unit.rows, unit.block
        sampling = rows[0].params.sampling
        logits_BTV = processed_logits(unit, part.out.logits_BTV)
        if sampling.greedy and isinstance(block, ChainBlock):
            fast = block.verify_greedy(self.rule, logits_BTV)
            if fast is not None:  # argmax matching: no noise
                return fast
        T = block.num_drafted + 1
        prompt_G = torch.tensor([len(r.prompt_ids) for r in rows], dtype=torch.long)
        offsets_T = block.forward_kwargs("cpu").get("depth_T", torch.arange(T))
        positions_GT = (start_G + 1 - prompt_G).unsqueeze(1) + offsets_T
        noise = PositionNoise([r.params.seed for r in rows], device=logits_BTV.device)
        return block.verify(
            self.rule, logits_BTV, sampling, noise=noise, positions_BK=positions_GT.to(logits_BTV.device)
        )
