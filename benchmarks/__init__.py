"""The benchmark suites of nxd_ckpt (not shipped in the wheel): ``python -m benchmarks SUITE [--sections ...]``.

``core/`` holds what every suite shares (state builders, timing and medians, the child-process and rank runners,
the load-average guard, the JSON + markdown report); ``measure/`` the measurements more than one suite reports
(the first async save); ``suites/`` one package or module per suite. ``python -m benchmarks --list`` lists the
suites, ``python -m benchmarks SUITE --list`` a suite's sections. docs/benchmarks.md gives the figures and the
command that produced each.
"""
