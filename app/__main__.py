"""``python -m glimpse``: the ``glimpse`` command."""

import sys

from glimpse.launcher import main

sys.exit(main())
