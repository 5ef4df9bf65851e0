"""NxD's ZeRO-1 optimizer state saved through DCP (``use_zero1_dcp=True``) read back into NxD's per-rank files.

What NxD writes (``neuronx_distributed/optimizer/zero_dcp_utils.py: save_optim_state_dict``): the ZeRO-1
``state_dict()`` of each rank, with ``base_state`` keyed by parameter name instead of index, every tensor of
more than 0 dims turned into a ``ShardedTensor`` over the DP group (global size = the parameter's shape, the
padding of the last DP chunk cut off), its key suffixed with ``|pp-PPPP`` (PP > 1) and ``|tp-TTTT`` (TP > 1),
saved by DCP's ``FileSystemWriter`` into ``<tag>/optim`` (``.metadata`` + ``__R_0.distcp``). Scalars (``step``)
keep their key and are saved once; ``param_groups`` and ``shape_info.<index>`` are saved once as bytes.

Here every slot of every parameter is read whole from the DCP files (DCP assembles the DP chunks) and cut again
into ZeRO-1 chunks for the requested DP size (``load/zero1``), written as ``optim/dp_rank_DD_tp_rank_TT_pp_rank_PP
.pt`` one slot at a time (``load/zero1_io``'s writers). The parameter index of each name is the optimizer's order
of parameters, which DCP's files do not hold: it comes from the caller (``param_order``), e.g.
``param_order_of(model, optimizer)`` on each PP stage, computed as NxD computes it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nxd_ckpt.errors import FormatError
from nxd_ckpt.format import layout
from nxd_ckpt.load import zero1
from nxd_ckpt.load.zero1_io import shard_writers
from nxd_ckpt.storage import LocalStorage
from nxd_ckpt.tools.dcp_io import DcpSource

_SUFFIX = re.compile(r"\|(pp|tp)-(\d{4})")
_BASE = "base_state."


def is_zero1_dcp(tag_dir: str) -> bool:
    """Whether ``<tag>/optim`` is a DCP checkpoint (NxD's ``use_zero1_dcp=True``)."""
    return os.path.isfile(os.path.join(tag_dir, layout.OPTIM_DIR, layout.DCP_METADATA_FILE))


def param_order_of(model: torch.nn.Module, optimizer: Any) -> list[str]:
    """Parameter names in the optimizer's index order, as NxD's ``_get_optim_pid_to_param_names`` builds them
    (indices count within each param group, as NxD counts them)."""
    names = {param: name for name, param in model.named_parameters()}
    by_pid = {pid: names[p] for g in optimizer.param_groups for pid, p in enumerate(g["params"])}
    return [by_pid[i] for i in sorted(by_pid)]


@dataclass(frozen=True)
class _Slot:
    fqn: str
    pname: str
    slot: str
    tp: int
    pp: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class NxdZero1Dcp:
    """The DCP checkpoint of one tag's ``optim/`` as NxD saved it: slots by (TP, PP) coordinate and name."""

    def __init__(self, tag_dir: str, *, allow_pickle: bool = False) -> None:
        self.path = os.path.join(tag_dir, layout.OPTIM_DIR)
        self.source = DcpSource(self.path, allow_pickle=allow_pickle)
        self.slots: list[_Slot] = []
        self.scalars: dict[tuple[str, str], tuple[torch.dtype, tuple[int, ...]]] = {}
        for fqn, dtype, shape in self.source.entries():
            if not fqn.startswith(_BASE):
                raise FormatError(
                    f"{self.path}: tensor {fqn!r} is not under base_state; NxD's use_zero1_dcp writes only "
                    "base_state tensors (no master weights), so this is not its format"
                )
            body, _, suffix = fqn[len(_BASE) :].partition("|")
            pname, _, slot = body.rpartition(".")
            coords = {k: int(v) for k, v in _SUFFIX.findall("|" + suffix)} if suffix else {}
            if not pname:
                raise FormatError(f"{self.path}: cannot tell the parameter of {fqn!r}")
            if not suffix and len(shape) == 0:
                self.scalars[(pname, slot)] = (dtype, shape)
            else:
                self.slots.append(_Slot(fqn, pname, slot, coords.get("tp", 0), coords.get("pp", 0), dtype, shape))
        if not self.slots:
            raise FormatError(f"{self.path} holds no ZeRO-1 optimizer tensors")
        self.tp = 1 + max(s.tp for s in self.slots)
        self.pp = 1 + max(s.pp for s in self.slots)
        try:
            self.param_groups = self.source.read_tree("param_groups")
        except KeyError:
            raise FormatError(f"{self.path} has no 'param_groups' entry; it is not NxD's ZeRO-1 DCP format") from None

    def names(self, tp: int, pp: int) -> list[str]:
        return list(dict.fromkeys(s.pname for s in self.slots if (s.tp, s.pp) == (tp, pp)))


def convert(
    dcp_optim: NxdZero1Dcp,
    storage: LocalStorage,
    tag: str,
    dp: int,
    param_order: Mapping[int, Sequence[str]],
    *,
    xser: bool = False,
) -> tuple[list[str], int]:
    """Write ``optim/dp_rank_..`` ZeRO-1 files for DP ``dp`` into ``tag``; return (files, bytes)."""
    files, nbytes = [], 0
    for pp in range(dcp_optim.pp):
        order = list(param_order.get(pp, ()))
        for tp in range(dcp_optim.tp):
            names = dcp_optim.names(tp, pp)
            unknown = sorted(set(names) - set(order))
            if unknown:
                raise FormatError(
                    f"{dcp_optim.path}: the parameter order given for PP stage {pp} does not name "
                    f"{', '.join(repr(n) for n in unknown[:5])}; pass the names in the optimizer's order "
                    "(param_order_of(model, optimizer) on that stage)"
                )
            f, n = _convert_coordinate(dcp_optim, storage, tag, tp, pp, dp, order, xser)
            files += f
            nbytes += n
    return files, nbytes


def _convert_coordinate(
    src: NxdZero1Dcp, storage: LocalStorage, tag: str, tp: int, pp: int, dp: int, order: list[str], xser: bool
) -> tuple[list[str], int]:
    slots = [s for s in src.slots if (s.tp, s.pp) == (tp, pp)]
    pid_of = {name: i for i, name in enumerate(order)}
    shapes = {pid_of[s.pname]: s.shape for s in slots}
    base_state: dict[int, dict[str, Any]] = {pid_of[n]: {} for n in dict.fromkeys(s.pname for s in slots)}
    for pname, slot in src.scalars:
        if pname in pid_of and pid_of[pname] in base_state:
            base_state[pid_of[pname]][slot] = src.source.read(f"{_BASE}{pname}.{slot}")
    groups = src.param_groups
    n_params = sum(len(g.get("params", [])) for g in groups)
    if n_params != len(order):
        if len(groups) != 1:
            raise FormatError(
                f"{src.path}: the saved param_groups hold {n_params} parameters but PP stage {pp} has {len(order)}; "
                "NxD's DCP save keeps one rank's param_groups, and with several groups their members cannot be told"
            )
        groups = [{**groups[0], "params": list(range(len(order)))}]
    small = {
        "state": {},  # the outer optimizer's (empty) state of torch_xla's ZeRO-1 state_dict; DCP drops empty dicts
        "param_groups": groups,
        "base_state": base_state,
        "shape_info": {pid: list(shape) for pid, shape in shapes.items()},
    }
    slot_meta = {("base_state", pid_of[s.pname], s.slot): (s.dtype, zero1.shard_shape(s.shape, dp)) for s in slots}
    paths = [layout.optim_file(tag, d, tp, pp) for d in range(dp)]
    nbytes = 0
    with shard_writers(storage, paths, small, slot_meta, use_xser=xser) as writers:
        for s in slots:
            full = src.source.read(s.fqn)
            entry = ("base_state", pid_of[s.pname], s.slot)
            for rank, w in enumerate(writers):
                part = zero1.shard_tensor(full, dp, rank)
                nbytes += w.fill(entry, lambda out, part=part: out.copy_(part))
                del part
            del full
    return paths, nbytes
