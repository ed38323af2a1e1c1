"""``python -m experiments``: see :mod:`experiments.cli`. Ctrl-C, during the imports (torch) too, is one
line and exit status 130."""

import sys

from specdec.cli_args import interrupt_watch

with interrupt_watch() as interrupted:
    try:
        from experiments.cli import main

        status = main()
    except KeyboardInterrupt:
        status = None
    except Exception:
        if not interrupted():  # else a library swallowed the interrupt and failed after it
            raise
        status = None
if status is None:
    print("python -m experiments: interrupted", file=sys.stderr)
    status = 130
raise SystemExit(status)
