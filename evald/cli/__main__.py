"""``python -m evald.cli``: the ``evald`` command without its console script."""

import sys

from evald.cli import main

sys.exit(main())
