"""Every ``NXD_CKPT_*`` environment variable, read here and nowhere else, with one parsing rule per kind.

- booleans: ``1``/``true``/``yes``/``on`` and ``0``/``false``/``no``/``off`` (any case);
- integers: decimal (``_`` separators allowed), at least the knob's minimum;
- durations: seconds, optionally with a unit: ``90``, ``90s``, ``5m``, ``1.5h``; more than 0;
- choices: one of the listed words (any case);
- sizes: bytes, optionally with a binary or decimal unit: ``536870912``, ``512MiB``, ``2GiB``, ``1.5GB``, ``64K``.

Unset or empty means the default. Anything else raises ``ValueError`` naming the variable, the value and what
it accepts, at the call that reads it (knobs are read at each use, so a test or a job can change them).
The table in docs/api.md lists ``KNOBS`` (``tests/unit/test_knobs.py`` keeps them in step).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_DURATION_RE = re.compile(r"^([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(ms|s|m|h)?$")
_UNITS = {None: 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_SIZE_RE = re.compile(r"^([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)(b?)$")
_SIZE_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


@dataclass(frozen=True)
class Knob:
    """One environment variable: its name, kind (bool, int, duration, size, choice, str), default and meaning."""

    name: str
    kind: str
    default: object
    doc: str
    minimum: int | None = None
    choices: tuple[str, ...] = ()


KNOBS: dict[str, Knob] = {
    k.name: k
    for k in (
        Knob("NXD_CKPT_IO_THREADS", "int", 4, "threads per rank reading and writing xser tensor files", minimum=1),
        Knob(
            "NXD_CKPT_XSER_INLINE_BYTES",
            "int",
            64 << 10,
            "xser tensors smaller than this stay inside the reference file (0: a file per tensor)",
            minimum=0,
        ),
        Knob("NXD_CKPT_DIRECT_IO", "bool", True, "0 sends local writes through the page cache instead of O_DIRECT"),
        Knob(
            "NXD_CKPT_REPLICA_READS",
            "choice",
            "auto",
            "`broadcast`: DP replicas on one host share xser reads by gloo broadcast instead of the page cache",
            choices=("auto", "broadcast"),
        ),
        Knob(
            "NXD_CKPT_XLA_TRANSFER_BATCH_BYTES",
            "int",
            256 << 20,
            "bytes per device-to-host (and host-to-device) bulk transfer",
            minimum=1,
        ),
        Knob(
            "NXD_CKPT_DEVICE_SNAPSHOT_BUDGET",
            "str",
            "auto",
            "most device memory an async save of device state (XLA, CUDA) copies the state into on the device before "
            "it returns (the copy travels to the host beside training); `auto`: 90% of what training left unused at "
            "its peak, measured once and agreed by the ranks (0 where the runtime reports no peak); a size (`8GiB`); "
            "0: none (the call transfers everything itself). The `device_snapshot_budget=` keyword overrides it",
        ),
        Knob(
            "NXD_CKPT_XLA_TRANSFER_THREAD",
            "bool",
            True,
            "0 makes synchronous saves copy device tensors to the host on the calling thread before writing "
            "(no overlap)",
        ),
        Knob(
            "NXD_CKPT_PREPARE_ON_RESUME",
            "bool",
            True,
            "0: a load of a tag saved with `async_save=True` does not end with `prepare_async_save` of the model and "
            "optimizer it restored (the first async save after the resume then pays its one-time costs)",
        ),
        Knob(
            "NXD_CKPT_TIMEOUT_S",
            "duration",
            1800.0,
            "deadline of every phase of a save or load (cross-rank steps, each file write, the commit); a storage "
            "call without progress for min(this / 2, 300 s) is a stall. The `timeout=` keyword overrides it per call",
        ),
        Knob(
            "NXD_CKPT_COMMIT_TIMEOUT_S",
            "duration",
            1800.0,
            "the old name of `NXD_CKPT_TIMEOUT_S`, still read when that one is unset",
        ),
        Knob("NXD_CKPT_LOG_ALL_RANKS", "bool", False, "1 lets every rank log at INFO"),
        Knob(
            "NXD_CKPT_PLATFORM",
            "str",
            None,
            "Neuron platform `initialize_model_parallel` builds NxD's groups for: `trn1`, `trn2`, `trn3`, `generic` "
            "(default: torch_neuronx's answer, else `generic`)",
        ),
        Knob("NXD_CKPT_S3_ENDPOINT_URL", "str", None, "S3 endpoint (MinIO, a proxy); else the AWS default chain"),
        Knob(
            "NXD_CKPT_S3_PART_SIZE",
            "int",
            16 << 20,
            "bytes per S3 multipart part, and the size from which a file is uploaded in parts (at least 5 MiB)",
            minimum=5 << 20,
        ),
        Knob(
            "NXD_CKPT_S3_MAX_CONCURRENCY",
            "int",
            10,
            "parts of one file uploaded or downloaded at once (memory per file written: this + 1 parts)",
            minimum=1,
        ),
        Knob(
            "NXD_CKPT_S3_TRANSFER_CLIENT",
            "choice",
            "auto",
            "transfer manager of large downloads and uploads of whole files: `crt` (AWS Common Runtime, the "
            "`s3-crt` extra), `classic` (boto3's threads); `auto`: crt when `awscrt` is installed and the endpoint "
            "is AWS's own",
            choices=("auto", "crt", "classic"),
        ),
        Knob(
            "NXD_CKPT_MEMORY_DIR",
            "str",
            None,
            "node-local directory of the memory tier (default `/dev/shm/nxd_ckpt`); `{node}` in it becomes the node "
            "index",
        ),
        Knob(
            "NXD_CKPT_HOST_MEMORY_BUDGET",
            "size",
            None,
            "most host memory an async save holds above what was in use before it (`512MiB`, `2GiB`); a larger "
            "state is staged and written in pieces while the save call waits. The `host_memory_budget=` keyword "
            "overrides it",
        ),
        Knob(
            "NXD_CKPT_DCP_LOAD_BUFFER",
            "size",
            None,
            "most bytes of a rank's DCP load `nxd_ckpt.dcp.StorageReader` holds until all of it is checked; ranges "
            "past it are checked, then read again as they are used (default: none from local files, which the "
            "page cache holds, 4GiB from S3). The `buffer_bytes=` keyword overrides it",
        ),
        Knob(
            "NXD_CKPT_MEMORY_TIER_HOST",
            "str",
            None,
            "host name or address peers reach this node's memory-tier file server at (default: the host name)",
        ),
    )
}


def _raw(name: str) -> str | None:
    if name not in KNOBS:
        raise KeyError(f"{name} is not an nxd_ckpt knob; known: {', '.join(KNOBS)}")
    value = os.environ.get(name)
    return None if value is None or not value.strip() else value.strip()


def _bad(name: str, raw: str, accepts: str) -> ValueError:
    return ValueError(f"environment variable {name}={raw!r} is not valid: {accepts}; unset it for the default")


def get_bool(name: str) -> bool:
    raw = _raw(name)
    if raw is None:
        return bool(KNOBS[name].default)
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise _bad(name, raw, "use 1 or 0 (true/false, yes/no, on/off)")


def get_int(name: str) -> int:
    knob = KNOBS[name]
    raw = _raw(name)
    if raw is None:
        return int(knob.default)  # type: ignore[call-overload]
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or (knob.minimum is not None and value < knob.minimum):
        at_least = f" >= {knob.minimum}" if knob.minimum is not None else ""
        raise _bad(name, raw, f"use an integer{at_least}")
    return value


def get_duration(name: str) -> float:
    """Seconds."""
    raw = _raw(name)
    if raw is None:
        return float(KNOBS[name].default)  # type: ignore[arg-type]
    m = _DURATION_RE.match(raw.lower())
    seconds = float(m.group(1)) * _UNITS[m.group(2)] if m else 0.0
    if seconds <= 0:
        raise _bad(name, raw, "use a duration > 0 in seconds, optionally with a unit (90, 90s, 5m, 1.5h)")
    return seconds


def parse_size(raw: str) -> int | None:
    """Bytes of a size such as ``512MiB``, ``2GiB``, ``1.5GB``, ``64k`` or ``4096`` (KiB/MiB/GiB/TiB and K/M/G/T
    are powers of 1024, kB/MB/GB/TB powers of 1000); None when it is not one or not above 0."""
    m = _SIZE_RE.match(raw.strip().lower())
    if not m or (m.group(3) and not m.group(2)):
        return None
    prefix, binary, suffix = m.group(2), m.group(3), m.group(4)
    base = 1000 if prefix and suffix and not binary else 1024
    value = int(float(m.group(1)) * base ** _SIZE_POWERS[prefix])
    return value if value > 0 else None


def get_size(name: str) -> int | None:
    """Bytes (``parse_size``), or the default (None: no limit)."""
    raw = _raw(name)
    if raw is None:
        return KNOBS[name].default  # type: ignore[return-value]
    value = parse_size(raw)
    if value is None:
        raise _bad(name, raw, "use a size > 0 in bytes, optionally with a unit (536870912, 512MiB, 2GiB, 1.5GB)")
    return value


def get_choice(name: str) -> str:
    knob = KNOBS[name]
    raw = _raw(name)
    if raw is None:
        return str(knob.default)
    if raw.lower() not in knob.choices:
        raise _bad(name, raw, f"use one of {', '.join(knob.choices)}")
    return raw.lower()


def get_str(name: str) -> str | None:
    raw = _raw(name)
    return raw if raw is not None else KNOBS[name].default  # type: ignore[return-value]


# ----------------------------------------------------------------------------------------------- the knobs
def io_threads() -> int:
    return get_int("NXD_CKPT_IO_THREADS")


def dcp_load_buffer_bytes() -> int | None:
    size = get_size("NXD_CKPT_DCP_LOAD_BUFFER")
    return None if size is None else int(size)


def xser_inline_bytes() -> int:
    return get_int("NXD_CKPT_XSER_INLINE_BYTES")


def direct_io() -> bool:
    return get_bool("NXD_CKPT_DIRECT_IO")


def replica_reads() -> str:
    return get_choice("NXD_CKPT_REPLICA_READS")


def xla_transfer_batch_bytes() -> int:
    return get_int("NXD_CKPT_XLA_TRANSFER_BATCH_BYTES")


def device_snapshot_budget() -> str:
    """The raw setting (``auto``, ``0`` or a size): ``device.backend.resolve_snapshot_budget`` parses it."""
    return get_str("NXD_CKPT_DEVICE_SNAPSHOT_BUDGET") or "auto"


def xla_transfer_thread() -> bool:
    return get_bool("NXD_CKPT_XLA_TRANSFER_THREAD")


def prepare_on_resume() -> bool:
    return get_bool("NXD_CKPT_PREPARE_ON_RESUME")


def timeout_s() -> float:
    """The deadline of every phase: NXD_CKPT_TIMEOUT_S, else its old name NXD_CKPT_COMMIT_TIMEOUT_S, else 1800 s."""
    if _raw("NXD_CKPT_TIMEOUT_S") is None and _raw("NXD_CKPT_COMMIT_TIMEOUT_S") is not None:
        return get_duration("NXD_CKPT_COMMIT_TIMEOUT_S")
    return get_duration("NXD_CKPT_TIMEOUT_S")


def log_all_ranks() -> bool:
    return get_bool("NXD_CKPT_LOG_ALL_RANKS")


def platform() -> str | None:
    return get_str("NXD_CKPT_PLATFORM")


def s3_endpoint_url() -> str | None:
    return get_str("NXD_CKPT_S3_ENDPOINT_URL")


def s3_part_size() -> int:
    return get_int("NXD_CKPT_S3_PART_SIZE")


def s3_max_concurrency() -> int:
    return get_int("NXD_CKPT_S3_MAX_CONCURRENCY")


def s3_transfer_client() -> str:
    return get_choice("NXD_CKPT_S3_TRANSFER_CLIENT")


def memory_dir() -> str | None:
    return get_str("NXD_CKPT_MEMORY_DIR")


def memory_tier_host() -> str | None:
    return get_str("NXD_CKPT_MEMORY_TIER_HOST")


def host_memory_budget() -> int | None:
    return get_size("NXD_CKPT_HOST_MEMORY_BUDGET")
