"""``python -m paper build``: see :mod:`paper.build`."""

from paper.build import main

raise SystemExit(main())
