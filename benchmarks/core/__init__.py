"""What the suites share: ``state`` (CPU state builders, the live module), ``devices`` (XLA and CUDA state and
operations), ``timing`` (timers, interleaving, medians), ``memory`` (peak host memory, CPU time, page faults),
``files`` (fsync, the page cache), ``ranks`` (gloo ranks and their gathers), ``child`` (a function in a fresh
process), ``loadguard`` (refuse a loaded machine) and ``report`` (one JSON + markdown report)."""
