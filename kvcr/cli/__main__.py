"""``python -m kvcr.cli``: the ``kvcr`` command."""

import sys

from kvcr.cli import main

sys.exit(main())
