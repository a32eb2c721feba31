"""``python -m clawray.train``: the training job, kept at this path for ``ray job submit``.

The job itself lives in :mod:`clawray.apps.train_job`; this module only runs it.
"""

from __future__ import annotations

import sys

from clawray.apps.train_job import main

if __name__ == "__main__":
    sys.exit(main())
