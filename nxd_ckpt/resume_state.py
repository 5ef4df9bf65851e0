"""Per-rank state for exact resume: data-loader positions and RNG streams, saved and restored on the same rank.

A rank's state is an object, or a dict of objects, with either ``state_dict()``/``load_state_dict()`` (e.g.
torchdata's ``StatefulDataLoader``) or Megatron Energon's ``save_state_rank()``/``restore_state_rank()``, plus
optionally the RNG snapshot of ``rng.capture_rng_state``. Two ways to store it (``mode``):

* ``"per_rank"``: every rank writes ``<tag>/nxd_ckpt/rank_state_<rank>.pt`` and reads it back; no collective.
* ``"gather"``: the states are gathered to the master, which writes ``<tag>/nxd_ckpt/rank_states.pt``; on load
  the master reads it and scatters each rank its part (Energon's ``save_state_global`` pattern).

Every file records the world size and the [PP, DP, TP] layout it was saved with: per-rank state belongs to a
rank of that layout, so loading it into another layout raises LayoutMismatchError instead of mismatching.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

from nxd_ckpt import statefile
from nxd_ckpt.device.transfer import to_host
from nxd_ckpt.errors import FormatError, LayoutMismatchError
from nxd_ckpt.format import layout
from nxd_ckpt.options import RANK_STATE_MODES
from nxd_ckpt.ranks.coordinator import Coordinator
from nxd_ckpt.ranks.topology import Topology
from nxd_ckpt.rng import capture_rng_state, keep_streams_through_first_iterator, restore_rng_state
from nxd_ckpt.storage import Storage

logger = logging.getLogger("nxd_ckpt")

FORMAT = "nxd_ckpt.rank_state"
FORMAT_VERSION = 1
SINGLE_KEY = "rank_state"
"""Key under which a single (non-dict) per-rank object is stored."""
_SKIP_HINT = (
    "pass skip_rank_state=True to load_checkpoint to load everything else and start the data loaders and "
    "random streams fresh"
)


def _protocol(obj: Any) -> str | None:
    """How ``obj`` saves itself: ``state_dict`` (torch/torchdata style), ``energon``, or None."""
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return "state_dict"
    if callable(getattr(obj, "save_state_rank", None)) and callable(getattr(obj, "restore_state_rank", None)):
        return "energon"
    return None


def normalize(objects: Any) -> tuple[dict[str, Any], bool]:
    """``({key: object}, single)`` for a stateful object, a dict of them, or None (nothing)."""
    if objects is None:
        return {}, False
    if _protocol(objects) is not None:
        return {SINGLE_KEY: objects}, True
    if isinstance(objects, Mapping):
        bad = [k for k, v in objects.items() if not isinstance(k, str) or _protocol(v) is None]
        if not bad:
            return dict(objects), False
        raise TypeError(
            f"rank_state[{bad[0]!r}] is a {type(objects[bad[0]]).__name__}: every value of a rank_state dict "
            "must have state_dict()/load_state_dict() or save_state_rank()/restore_state_rank(), under a str key"
        )
    raise TypeError(
        f"rank_state is a {type(objects).__name__}; pass an object with state_dict()/load_state_dict() (e.g. "
        "a torchdata StatefulDataLoader) or save_state_rank()/restore_state_rank(), or a dict of such objects"
    )


def _layout_of(topo: Topology) -> dict[str, int]:
    return {"world_size": topo.world_size, "tp": topo.tp_size, "pp": topo.pp_size, "dp": topo.dp_size}


def _describe(saved: dict[str, int]) -> str:
    return f"TP={saved['tp']} PP={saved['pp']} DP={saved['dp']} (world {saved['world_size']})"


def capture(objects: Any, topo: Topology, *, save_rng: bool) -> dict[str, Any] | None:
    """This rank's per-rank payload (object states + RNG), or None when there is nothing to save."""
    targets, single = normalize(objects)
    if not targets and not save_rng:
        return None
    states: dict[str, Any] = {}
    for key, obj in targets.items():
        protocol = _protocol(obj)
        state = obj.state_dict() if protocol == "state_dict" else obj.save_state_rank()
        states[key] = {"protocol": protocol, "state": state}
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "rank": topo.rank,
        "layout": _layout_of(topo),
        "single": single,
        "objects": states,
        "rng": capture_rng_state() if save_rng else None,
    }


def stage_for_save(
    coord: Coordinator,
    topo: Topology,
    tag: str,
    objects: Any,
    *,
    save_rng: bool,
    mode: str,
    copy_state: bool,
) -> list[tuple[str, Any]]:
    """The (path, host state) files this rank writes for its per-rank state, ready for the write pipeline.

    ``copy_state`` makes the snapshot independent of the live objects (async saves). In ``gather`` mode this is
    a collective: every rank must call it with the same ``mode`` and with per-rank state to save.
    """
    validate_mode(mode)
    if not normalize(objects)[0] and not save_rng:
        return []

    def snapshot() -> Any:
        host = to_host(capture(objects, topo, save_rng=save_rng), copy=False)
        return copy.deepcopy(host) if copy_state else host

    # Collective even in per_rank mode: a rank whose state_dict() fails must not leave the others waiting.
    host = coord.run_all(snapshot, f"capturing the per-rank state for {tag!r}")
    if mode == "per_rank":
        return [(layout.rank_state_file(tag, topo.rank), host)]
    gathered = coord.gather_object(host, dst=0, phase=f"gathering the per-rank state for {tag!r}")
    if coord.rank != 0:
        return []
    gathered_file = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "mode": "gather",
        "layout": _layout_of(topo),
        "ranks": gathered,
    }
    return [(layout.gathered_rank_states_file(tag), gathered_file)]


def validate_mode(mode: str) -> None:
    if mode not in RANK_STATE_MODES:
        raise ValueError(f"rank_state_mode must be one of {', '.join(map(repr, RANK_STATE_MODES))}, got {mode!r}")


def files_read(tag: str, rank: int) -> list[str]:
    """The per-rank state files ``restore`` may read on ``rank``: its own file, and on the master (which probes
    which pattern the tag used) the gathered file too; the other ranks get theirs from it by a scatter."""
    own = [layout.rank_state_file(tag, rank)]
    return [*own, layout.gathered_rank_states_file(tag)] if rank == 0 else own


def restore(
    coord: Coordinator,
    storage: Storage,
    tag: str,
    topo: Topology,
    objects: Any,
    *,
    trusted: bool = False,
) -> bool:
    """Restore this rank's per-rank objects and RNG streams from ``tag``; every rank must call it.

    RNG streams are restored whenever the checkpoint holds them. Returns whether per-rank state was found.
    Raises LayoutMismatchError (on every rank) if the checkpoint's world size or layout differs from ``topo``.
    """
    targets, single = normalize(objects)
    url = f"{storage.url}/{tag}"
    kept: dict[str, Any] = {}

    def probe() -> dict[str, Any] | None:
        """On the master: which pattern the checkpoint used, and the layout it recorded."""
        gathered_path = layout.gathered_rank_states_file(tag)
        if storage.exists(gathered_path):
            data = _check_format(statefile.read_plain(storage, gathered_path, trusted=trusted), storage, gathered_path)
            kept["ranks"] = data["ranks"]
            first = data["ranks"][0] if data["ranks"] else {}
            return {"mode": "gather", "layout": data["layout"], "has_rng": first.get("rng") is not None}
        own_path = layout.rank_state_file(tag, 0)
        if storage.exists(own_path):
            payload = _check_format(statefile.read_plain(storage, own_path, trusted=trusted), storage, own_path)
            kept["own"] = payload
            return {"mode": "per_rank", "layout": payload["layout"], "has_rng": payload.get("rng") is not None}
        return None

    header = coord.master_computes(probe, f"reading the per-rank state of {url}")
    if header is None:
        if targets:
            raise FormatError(
                f"checkpoint {url} holds no per-rank state (it was saved without rank_state= or save_rng=); "
                f"{_SKIP_HINT}"
            )
        return False
    if not targets and not header["has_rng"]:
        return True
    saved = header["layout"]
    if saved != _layout_of(topo):
        raise LayoutMismatchError(
            f"checkpoint {url} holds per-rank state (data loaders, RNG) of {_describe(saved)}, but this job "
            f"runs {topo.describe()}: per-rank state belongs to one rank of the saved layout and cannot be "
            f"mapped to another world size or layout. Resume with the saved layout, or {_SKIP_HINT}."
        )

    if header["mode"] == "gather":
        payload = coord.scatter_object(kept.get("ranks"), src=0, phase=f"handing out the per-rank state of {url}")
    else:

        def read_own() -> dict[str, Any]:
            if "own" in kept:
                return kept["own"]
            path = layout.rank_state_file(tag, topo.rank)
            if not storage.exists(path):
                raise FormatError(f"per-rank state file {storage.url}/{path} is missing; {_SKIP_HINT}")
            return _check_format(statefile.read_plain(storage, path, trusted=trusted), storage, path)

        payload = coord.run_all(read_own, f"reading the per-rank state of {url}")

    def apply() -> None:
        _apply(payload, targets, single, topo.rank, url)

    coord.run_all(apply, f"restoring the per-rank state of {url}")
    return True


def _check_format(data: Any, storage: Storage, path: str) -> Any:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise FormatError(f"{storage.url}/{path} is not an nxd_ckpt per-rank state file")
    if data.get("format_version", 0) > FORMAT_VERSION:
        raise FormatError(
            f"{storage.url}/{path} has per-rank state format version {data['format_version']}, newer than this "
            f"nxd_ckpt understands ({FORMAT_VERSION}); upgrade nxd_ckpt"
        )
    return data


def _apply(payload: dict[str, Any], targets: dict[str, Any], single: bool, rank: int, url: str) -> None:
    """Load the saved states into ``targets`` and restore the RNG streams; objects first, RNG last."""
    if payload.get("rank") != rank:
        raise FormatError(f"per-rank state for rank {rank} in {url} belongs to rank {payload.get('rank')}")
    saved: dict[str, Any] = payload["objects"]
    if targets:
        if single != payload["single"]:
            shape = "a single object" if payload["single"] else f"a dict with keys {sorted(saved)}"
            raise KeyError(f"{url} holds per-rank state saved as {shape}; pass rank_state in the same shape to load it")
        missing = sorted(set(targets) - set(saved))
        if missing:
            raise KeyError(f"{url} holds no per-rank state for key(s) {missing}; saved keys: {sorted(saved)}")
    unused = sorted(set(saved) - set(targets))
    if unused and rank == 0:
        logger.info("per-rank state %s in %s was saved but not asked for; not restored", unused, url)
    for key, obj in targets.items():
        entry = saved[key]
        protocol = _protocol(obj)
        if protocol != entry["protocol"]:
            raise TypeError(
                f"per-rank state {key!r} in {url} was saved through {entry['protocol']} but the object passed "
                f"now ({type(obj).__name__}) uses {protocol}"
            )
        if protocol == "state_dict":
            obj.load_state_dict(entry["state"])
        else:
            obj.restore_state_rank(entry["state"])
    if payload.get("rng") is not None:
        restore_rng_state(payload["rng"], source=url)
        for obj in targets.values():  # a rebuilt loader's first iterator must not draw from the restored streams
            keep_streams_through_first_iterator(obj)
