"""Tests that need an optional extra skip with a reason that names it (never an import error)."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import pytest

SERVE = ("fastapi", "uvicorn", "sse_starlette", "prometheus_client", "httpx")
"""What the server's tests import: the ``[serve]`` extra (httpx comes with it)."""


def skip_module_without(modules: Sequence[str], extra: str = "serve") -> None:
    """Skip the calling test module (at import) when any of ``modules`` is missing, naming the extra
    that installs them."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(
            f"needs the [{extra}] extra (pip install -e '.[{extra}]'): missing {', '.join(missing)}",
            allow_module_level=True,
        )
