"""Cross-origin requests: CORS headers for the origins the server allows, none by default.

A browser page on another origin (a web UI on ``http://localhost:3000``) may call the API only where
the response allows its origin. ``specdec serve --allowed-origins ORIGIN ...`` (vLLM's flag; with
``--allowed-methods`` and ``--allowed-headers``, both ``*`` by default) puts Starlette's
``CORSMiddleware`` in front of the app: it answers preflight ``OPTIONS`` requests itself (before the
API key is checked, as browsers send them without it) and adds ``Access-Control-Allow-Origin`` to the
responses of allowed origins. Without ``--allowed-origins`` there is no middleware and no CORS
header, so browsers keep other origins' pages from reading the responses.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

__all__ = ["add_cors", "check_cors"]

_ORIGIN = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/\s?#]+")  # scheme://host[:port], as browsers send it
_METHOD = re.compile(r"[A-Za-z]+")
_HEADER = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")  # an HTTP token


def check_cors(origins: Sequence[str], methods: Sequence[str], headers: Sequence[str]) -> None:
    """A ``ValueError`` naming the flag for an origin that is not ``*`` or ``scheme://host[:port]``
    (a trailing ``/`` would never match a browser's ``Origin``), a method or a header name that is not
    ``*`` or a token."""
    for flag, values, form, expected in (
        ("--allowed-origins", origins, _ORIGIN, "'*' or scheme://host[:port] with no path"),
        ("--allowed-methods", methods, _METHOD, "'*' or a method name such as POST"),
        ("--allowed-headers", headers, _HEADER, "'*' or a header name such as Authorization"),
    ):
        if isinstance(values, str):
            raise ValueError(f"{flag} must be a list of strings, got the string {values!r:.80}")
        for v in values:
            if not isinstance(v, str) or (v != "*" and not form.fullmatch(v)):
                raise ValueError(f"{flag}: each value must be {expected}, got {v!r:.80}")


def add_cors(app: Any, origins: Sequence[str], methods: Sequence[str], headers: Sequence[str]) -> None:
    """Answer CORS for ``origins`` on ``app`` (nothing when there are none); call before it serves."""
    check_cors(origins, methods, headers)
    if not origins:
        return
    from starlette.middleware.cors import CORSMiddleware

    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(origins),
        allow_methods=[m.upper() for m in methods],
        allow_headers=list(headers),
    )
