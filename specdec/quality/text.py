"""The held-out text quality is measured on: Python's documentation topics (``pydoc_data``).

Every Python install has ``pydoc_data.topics.topics`` (the language reference's sections, a dict of
plain English text with code examples). In sorted name order, every :data:`HELDOUT_EVERY`-th topic
is held out: those make the quality text (:func:`pydoc_text`), and no drafter trains on them (the
``bigram`` / ``unigram`` counts read :func:`training_topics` only, and the EAGLE recipe's text files
skip ``pydoc_data``; ``tests/test_perplexity.py`` checks both). The text is fixed for a given Python
version; its sha256 goes into every result.

    python -m specdec.quality.text pydoc-heldout.txt    # write it, for --text
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

__all__ = ["HELDOUT_EVERY", "heldout_topics", "training_topics", "pydoc_text", "text_info", "main"]

HELDOUT_EVERY = 4
"""Topics ``i % 4 == 3`` in sorted order are held out (a quarter, ~115 k characters on Python 3.11)."""


def _topics() -> dict[str, str]:
    from pydoc_data.topics import topics

    return topics


def heldout_topics() -> list[str]:
    """The held-out topic names, in sorted order."""
    names = sorted(_topics())
    return [n for i, n in enumerate(names) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]


def training_topics() -> list[str]:
    """The other topic names (what drafters may train on), in sorted order."""
    held = set(heldout_topics())
    return [n for n in sorted(_topics()) if n not in held]


def pydoc_text() -> str:
    """The held-out topics' text, in sorted name order, separated by a blank line."""
    topics = _topics()
    return "\n\n".join(topics[n].strip("\n") for n in heldout_topics()) + "\n"


def text_info(text: str) -> dict[str, object]:
    """Where the text comes from: Python version, topics, characters, sha256."""
    return {
        "source": "pydoc_data.topics (held-out topics)",
        "python": sys.version.split()[0],
        "topics": len(heldout_topics()),
        "chars": len(text),
        "sha256": hashlib.sha256(text.encode()).hexdigest(),
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m specdec.quality.text FILE``: write :func:`pydoc_text` to FILE."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m specdec.quality.text FILE", file=sys.stderr)
        return 2
    text = pydoc_text()
    Path(args[0]).write_text(text, encoding="utf-8")
    info = text_info(text)
    print(f"{args[0]}: {info['topics']} topics, {info['chars']} characters, sha256 {info['sha256'][:16]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
