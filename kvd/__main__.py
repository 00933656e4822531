"""``python -m kvd`` is the ``kvd`` command."""

from kvd.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
