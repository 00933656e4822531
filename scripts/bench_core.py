#!/usr/bin/env python3
"""Thin wrapper: the in-process benchmark lives in the package (``kvd.bench.core``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from kvd.bench.core import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
