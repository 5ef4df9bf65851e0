"""Capture and restore this process's random streams, so dropout and sampling continue exactly after a resume.

Covered: Python's ``random``, NumPy's global generator, torch's CPU generator, and the device generator
(torch_xla's RNG seed when the program already imported torch_xla; every CUDA device when CUDA is available).
The captured state holds only ints, floats, lists, tuples and CPU tensors, so it loads with
``torch.load(weights_only=True)``. torch_xla is never imported here: it is used only if already loaded.
"""

from __future__ import annotations

import logging
import random
import sys
from typing import Any

import numpy as np
import torch

logger = logging.getLogger("nxd_ckpt")

RNG_FORMAT_VERSION = 1


def _xla_model() -> Any | None:
    """``torch_xla.core.xla_model`` if the program imported torch_xla (a device RNG is in use only then)."""
    if sys.modules.get("torch_xla") is None:
        return None
    import torch_xla.core.xla_model as xm

    return xm


def _numpy_state() -> dict[str, Any]:
    name, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    return {
        "bit_generator": str(name),
        "key": [int(k) for k in key],
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "gauss": float(gauss),
    }


def _set_numpy_state(state: dict[str, Any]) -> None:
    key = np.asarray(state["key"], dtype=np.uint32)
    np.random.set_state((state["bit_generator"], key, state["pos"], state["has_gauss"], state["gauss"]))


def capture_rng_state() -> dict[str, Any]:
    """A snapshot of every random stream of this process; reading it does not advance any stream."""
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "version": RNG_FORMAT_VERSION,
        "python": (int(version), tuple(int(v) for v in internal), gauss_next),
        "numpy": _numpy_state(),
        "torch_cpu": torch.get_rng_state(),
        "cuda": None,
        "xla": None,
    }
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    xm = _xla_model()
    if xm is not None:
        state["xla"] = int(xm.get_rng_state())
    return state


def restore_rng_state(state: dict[str, Any], *, source: str = "the checkpoint") -> None:
    """Put every random stream back to ``state`` (from ``capture_rng_state``); warn about device streams that
    were saved but cannot be restored here (or exist here but were not saved)."""
    if not isinstance(state, dict) or "torch_cpu" not in state:
        raise ValueError(f"RNG state in {source} is not an nxd_ckpt RNG snapshot (keys: {_keys(state)})")
    version, internal, gauss_next = state["python"]
    random.setstate((int(version), tuple(int(v) for v in internal), gauss_next))
    _set_numpy_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"].cpu())
    _restore_cuda(state.get("cuda"), source)
    _restore_xla(state.get("xla"), source)


def _restore_cuda(saved: list[torch.Tensor] | None, source: str) -> None:
    available = torch.cuda.is_available()
    if saved is None:
        if available:
            logger.warning("%s has no CUDA RNG state; the CUDA random streams are not restored", source)
        return
    if not available:
        logger.warning("%s holds a CUDA RNG state but CUDA is not available; it is not restored", source)
        return
    count = torch.cuda.device_count()
    if len(saved) != count:
        logger.warning(
            "%s holds the CUDA RNG state of %d devices but %d are visible; restoring the first %d",
            source,
            len(saved),
            count,
            min(len(saved), count),
        )
    for index, device_state in enumerate(saved[:count]):
        torch.cuda.set_rng_state(device_state.cpu(), device=index)


def _restore_xla(saved: int | None, source: str) -> None:
    xm = _xla_model()
    if saved is None:
        if xm is not None:
            logger.warning("%s has no XLA RNG state; the XLA device's random stream is not restored", source)
        return
    if xm is None:
        logger.warning("%s holds an XLA RNG state but torch_xla is not in use; it is not restored", source)
        return
    xm.set_rng_state(int(saved))


def _keys(state: Any) -> str:
    return ", ".join(map(str, state)) if isinstance(state, dict) else type(state).__name__


def keep_streams_through_first_iterator(loader: Any) -> bool:
    """Make the first iterator ``loader`` creates after a resume leave the host random streams as they were.

    Creating a torch ``DataLoader`` iterator draws its workers' base seed (and a shared seed) from the loader's
    ``generator``, or from torch's global generator when it has none (Energon's ``SavableDataLoader``, and any
    ``DataLoader`` built without ``generator=``). The run that saved made that draw when its iterator was created,
    before the save; the resumed run makes it again, after the restore, which shifts every later dropout mask.
    So the first ``_get_iterator`` call after the restore is wrapped: the Python, NumPy and torch CPU streams are
    put back after it, as if the iterator had existed all along. Later iterators (new epochs) draw as usual.
    Returns whether ``loader`` is a ``DataLoader`` that draws from the global generator (and so was wrapped).
    """
    from torch.utils.data import DataLoader

    if not isinstance(loader, DataLoader) or getattr(loader, "generator", None) is not None:
        return False
    if getattr(loader.__dict__.get("_get_iterator"), "_nxd_ckpt_resume", False):
        return True  # already wrapped by an earlier load that has not iterated yet
    create = loader._get_iterator

    def first_iterator_after_resume() -> Any:
        python, numpy_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
        try:
            return create()
        finally:
            loader.__dict__.pop("_get_iterator", None)  # one iterator only
            random.setstate(python)
            np.random.set_state(numpy_state)
            torch.set_rng_state(torch_state)

    first_iterator_after_resume._nxd_ckpt_resume = True  # type: ignore[attr-defined]
    loader.__dict__["_get_iterator"] = first_iterator_after_resume
    return True
