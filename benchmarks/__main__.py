"""``python -m benchmarks SUITE ...``: see ``benchmarks.cli``."""

from benchmarks.cli import main

raise SystemExit(main())
