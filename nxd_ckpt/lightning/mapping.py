"""Lightning's checkpoint in nxd_ckpt's terms: its path -> (checkpoint directory, tag), its dict -> (model,
optimizer, user content), as NxDT's ``NLPCheckpointIO`` maps them."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from typing import Any

_VERSION_SUFFIX = re.compile(r"-v\d+(?=(\.[^.]*)?$)")
"""Lightning's version counter: ``-vN`` right before the file extension (or at the end of a name without one)."""


def checkpoint_location(path: str | os.PathLike[str], strip_version: bool = True) -> tuple[str, str]:
    """Lightning's checkpoint path -> (checkpoint directory, tag).

    ``ckpts/epoch=0-step=4.ckpt`` -> ``("ckpts", "epoch=0-step=4.ckpt")``; ``ckpts/last-v1.ckpt`` ->
    ``("ckpts", "last.ckpt")`` with ``strip_version`` (NxDT's behaviour; NxDT cuts from the first ``-v`` anywhere in
    the path, which mangles names such as ``val-vloss=...``: only a ``-v<digits>`` counter is removed here).
    ``s3://bucket/run/last.ckpt`` -> ``("s3://bucket/run", "last.ckpt")``.
    """
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"a Lightning checkpoint path must be a str or os.PathLike of str, got {path!r}")
    text = text.rstrip("/")
    directory, name = os.path.split(text)
    if not name:
        raise ValueError(f"Lightning checkpoint path {path!r} has no file name: expected DIR/NAME.ckpt")
    if strip_version:
        name = _VERSION_SUFFIX.sub("", name)
    return directory or ".", name


def split_checkpoint(checkpoint: Mapping[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """Lightning's checkpoint dict -> (model state, optimizer state or None, user content), as NxDT splits it.

    ``optimizer_states`` holds one state per optimizer: exactly one goes to the optimizer; none (a module without
    optimizers) stays in the user content as ``[]``; absent (``save_weights_only``) means no optimizer; more than
    one is refused, as by NxDT (an nxd_ckpt tag holds one optimizer). ``checkpoint`` itself is not modified."""
    if "state_dict" not in checkpoint:
        raise KeyError("Lightning's checkpoint dict has no 'state_dict' (the model's weights); nothing to save")
    rest = {k: v for k, v in checkpoint.items() if k != "state_dict"}
    optimizer = None
    states = rest.get("optimizer_states")
    if states is not None:
        if len(states) > 1:
            raise ValueError(
                f"the Lightning module has {len(states)} optimizers; an nxd_ckpt checkpoint holds one optimizer "
                "(as NxD's and NxDT's): use one optimizer with several parameter groups"
            )
        if len(states) == 1:
            optimizer = rest.pop("optimizer_states")[0]
    return checkpoint["state_dict"], optimizer, _plain_config(rest)


def _plain_config(content: dict[str, Any]) -> dict[str, Any]:
    """OmegaConf containers in the user content become plain dicts and lists (as NxDT does), so that they load
    without unpickling OmegaConf classes; nothing changes when OmegaConf is not in use."""
    omegaconf = sys.modules.get("omegaconf")
    if omegaconf is None:
        return content
    from lightning_utilities.core.apply_func import apply_to_collection

    containers = (omegaconf.DictConfig, omegaconf.ListConfig)
    return apply_to_collection(content, containers, omegaconf.OmegaConf.to_container)


def zero1_from_config(content: Mapping[str, Any]) -> bool:
    """NxDT's switch for ZeRO-1 optimizer state: ``hyper_parameters["cfg"]["wrap_with_zero"]`` (False if absent)."""
    hparams = content.get("hyper_parameters")
    cfg = hparams.get("cfg") if isinstance(hparams, Mapping) else None
    return bool(cfg.get("wrap_with_zero", False)) if isinstance(cfg, Mapping) else False
