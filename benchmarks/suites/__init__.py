"""One package or module per suite; ``benchmarks.cli.SUITES`` names them."""
