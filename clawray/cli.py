"""``python -m clawray.cli``: the ``clawray`` command, kept at this path for existing scripts.

The commands live in :mod:`clawray.apps.cli`; this module only runs them.
"""

from __future__ import annotations

import sys

from clawray.apps.cli import main

if __name__ == "__main__":
    sys.exit(main())
