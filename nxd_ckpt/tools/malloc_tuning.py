"""Memory behaviour of the offline tools' own processes (the ``nxd-ckpt`` commands), never of a training job.

The tools allocate and free one whole tensor after another, of varying sizes. glibc serves blocks below its
dynamic mmap threshold (which grows up to 32 MiB) from heaps it keeps after ``free``, so freed tensors of one
size are not reused for the next size and the peak grows past two tensors. With large blocks always mmap-ed,
each freed tensor goes back to the system at once; measured by ``python -m benchmarks layout_tools_memory``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_MMAP_THRESHOLD = -3
LARGE_BLOCK_BYTES = 1 << 20


def return_large_blocks_to_the_system() -> bool:
    """Make glibc mmap every block of 1 MiB or more in this process (freed at once); False where not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, LARGE_BLOCK_BYTES))
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
