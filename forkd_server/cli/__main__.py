"""``python -m forkd_server.cli``: the ``forkd`` command."""

import sys

from . import main

sys.exit(main())
