"""What a running server says about itself: ``GET /health``, ``/v1/models`` and ``/metrics``.

:func:`scrape_metrics` and :func:`acceptance` read the server's Prometheus ``/metrics`` before and
after a load level of ``specdec bench-serve``: vLLM's ``…:spec_decode_num_drafts``,
``…:spec_decode_num_draft_tokens`` and ``…:spec_decode_num_accepted_tokens`` counters (``specdec serve``
exposes them as ``vllm:…``, llama-server with ``--metrics`` as ``llamacpp:…``), and
``…:spec_decode_num_accepted_tokens_per_pos`` (label ``position``, 0-based), which both expose too:
:func:`scrape_speculation` reads both at once, :func:`per_position` turns the per-position counts
into acceptance rates.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from typing import Any

import httpx

__all__ = [
    "SPEC_COUNTERS",
    "parse_prometheus_text",
    "spec_counters",
    "get_metrics",
    "scrape_metrics",
    "accepted_per_position",
    "scrape_speculation",
    "acceptance",
    "per_position",
    "model_card",
    "wait_healthy",
]

SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
"""The speculative-decoding counters read from ``/metrics`` (names ``<prefix>:spec_decode_<name>``)."""


def parse_prometheus_text(text: str, *, keep_label: str | None = None) -> dict[str, float]:
    """Prometheus text exposition → ``{sample name: value summed over its label sets}`` (comments,
    blank lines and samples whose value is not a number are skipped). Samples that carry the label
    ``keep_label`` are summed per value of it, as ``name{value}``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, _, rest = line.partition("{")
            labels, _, rest = rest.rpartition("}")
            kept = re.search(rf'(?:^|,)\s*{keep_label}="([^"]*)"', labels) if keep_label else None
            name = f"{name.strip()}{{{kept.group(1)}}}" if kept else name
        else:
            name, _, rest = line.partition(" ")
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        out[name.strip()] = out.get(name.strip(), 0.0) + value
    return out


def spec_counters(samples: Mapping[str, float]) -> dict[str, float] | None:
    """The :data:`SPEC_COUNTERS` among parsed ``/metrics`` samples: a sample named
    ``<prefix>:spec_decode_<counter>`` (with or without ``_total``) counts, ``_created`` and
    ``…_per_pos`` samples do not; None when the server exposes none of them."""
    found: dict[str, float] = {}
    for name, value in samples.items():
        base = name.removesuffix("_total")
        prefix, colon, metric = base.rpartition(":")
        if not colon or not prefix:
            continue
        for counter in SPEC_COUNTERS:
            if metric == f"spec_decode_{counter}":
                found[counter] = found.get(counter, 0.0) + value
    if not found:
        return None
    return {counter: found.get(counter, 0.0) for counter in SPEC_COUNTERS}


def get_metrics(
    base_url: str, *, timeout_s: float = 10.0, api_key: str | None = None, keep_label: str | None = None
) -> dict[str, float] | None:
    """``GET /metrics`` parsed (:func:`parse_prometheus_text`); None when the server has none."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(base_url.rstrip("/") + "/metrics", timeout=timeout_s, headers=headers)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return parse_prometheus_text(response.text, keep_label=keep_label)


def scrape_metrics(base_url: str, *, timeout_s: float = 10.0, api_key: str | None = None) -> dict | None:
    """The server's speculative-decoding counters now (:func:`spec_counters`); None when it has no
    ``/metrics`` or no such counters."""
    samples = get_metrics(base_url, timeout_s=timeout_s, api_key=api_key)
    return None if samples is None else spec_counters(samples)


def accepted_per_position(samples: Mapping[str, float]) -> list[float] | None:
    """``<prefix>:spec_decode_num_accepted_tokens_per_pos`` per position, from samples parsed with
    ``keep_label="position"`` (a position the server has not reached yet counts 0); None without them."""
    found: dict[int, float] = {}
    for name, value in samples.items():
        metric, brace, label = name.partition("{")
        prefix, colon, base = metric.removesuffix("_total").rpartition(":")
        if brace and colon and prefix and base == "spec_decode_num_accepted_tokens_per_pos":
            position = label.removesuffix("}")
            if position.isdigit():
                found[int(position)] = found.get(int(position), 0.0) + value
    if not found:
        return None
    return [found.get(k, 0.0) for k in range(max(found) + 1)]


def scrape_speculation(
    base_url: str, *, timeout_s: float = 10.0, api_key: str | None = None
) -> tuple[dict[str, float] | None, list[float] | None]:
    """One ``GET /metrics``: the speculative-decoding counters (:func:`spec_counters`) and the accepted
    tokens per draft position (:func:`accepted_per_position`); None for what the server lacks."""
    samples = get_metrics(base_url, timeout_s=timeout_s, api_key=api_key, keep_label="position")
    if samples is None:
        return None, None
    return spec_counters(samples), accepted_per_position(samples)


def per_position(
    before: list[float] | None, after: list[float] | None, drafts: float | None
) -> list[float] | None:
    """Acceptance rate at each draft position over a level: accepted at position k / drafts (vLLM's
    and llama-server's per-position rate); None without the counts or without drafts."""
    if after is None or not drafts:
        return None
    before = before or []
    return [(n - (before[k] if k < len(before) else 0.0)) / drafts for k, n in enumerate(after)]


def acceptance(before: Mapping[str, float] | None, after: Mapping[str, float] | None) -> dict | None:
    """Speculation over a level from the counters before and after it: ``drafts`` (verify steps that
    drafted), ``drafted`` and ``accepted`` tokens, α = accepted / drafted and τ = 1 + accepted /
    drafts (vLLM's mean acceptance length; None without drafts). None without counters."""
    if before is None or after is None:
        return None
    drafts, drafted, accepted = (after[c] - before[c] for c in SPEC_COUNTERS)
    return {
        "drafts": drafts,
        "drafted": drafted,
        "accepted": accepted,
        "alpha": accepted / drafted if drafted > 0 else None,
        "tau": 1.0 + accepted / drafts if drafts > 0 else None,
    }


def model_card(base_url: str, *, timeout_s: float = 10.0, api_key: str | None = None) -> dict | None:
    """The first entry of ``GET /v1/models`` (its ``id`` a string); None if the server does not say."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=timeout_s, headers=headers)
        data = response.json().get("data") if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    if isinstance(data, list) and data and isinstance(data[0], dict) and isinstance(data[0].get("id"), str):
        return data[0]
    return None


def wait_healthy(base_url: str, timeout_s: float, *, alive: Any = None) -> bool:
    """Poll ``GET /health`` until it answers 200 (True), ``timeout_s`` passes or ``alive()`` turns
    false (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            return False
        try:
            if httpx.get(base_url.rstrip("/") + "/health", timeout=5.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False
