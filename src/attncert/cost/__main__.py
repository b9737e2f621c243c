"""``python -m attncert.cost``: see :mod:`attncert.cost.cli`."""

from attncert.cost.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
