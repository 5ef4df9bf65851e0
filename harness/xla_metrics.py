"""torch_xla's own counters (graphs compiled, graphs run) read in a test: how many graphs a save cost."""

from __future__ import annotations


def xla_graph_compiles() -> int:
    """Graphs torch_xla compiled so far in this process (its ``CompileTime`` metric's count)."""
    return _xla_metric_count("CompileTime")


def xla_graph_executions() -> int:
    """Graphs torch_xla ran so far in this process (its ``ExecuteTime`` metric's count)."""
    return _xla_metric_count("ExecuteTime")


def _xla_metric_count(name: str) -> int:
    import torch_xla.debug.metrics as met

    data = met.metric_data(name)
    return int(data[0]) if data else 0
