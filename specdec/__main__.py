"""``python -m specdec``: the ``specdec`` command (:func:`specdec.cli.main`). Ctrl-C, during the imports
too, is one line and exit status 130."""

import sys

try:
    from specdec.cli import main
except KeyboardInterrupt:
    print("specdec: interrupted", file=sys.stderr)
    raise SystemExit(130) from None

raise SystemExit(main())
