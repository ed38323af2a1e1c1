"""``python -m specdec.bench``: the same as ``specdec bench``."""

import sys

from specdec.bench.speculative import main

sys.exit(main())
