"""What one rank reads of one resolved tag, and into what: a value decided before anything is read.

Like DCP's ``LoadPlan``, ``plan_read`` is a pure function (of the tag's description, ``format.describe``, this
job's layout and the targets the load fills) returning a frozen ``ReadPlan``; ``load.read`` executes it. The
same layout (the TP/PP sizes the tag was saved at) reads this rank's own files: the model file of its (TP, PP[,
EP]) coordinate into the live model, its ZeRO-1 shard (or only the rows it covers, when the DP size changed)
or its coordinate's replicated optimizer state into the live optimizer; DP replicas reading one xser file share
the reads. Another TP/PP size is re-sharded (``load.reshard``: each rank reads only the parts it holds now).
``files_read`` is every file a rank may read (the master hands each rank its share of the manifests by it).
"""

from __future__ import annotations

from dataclasses import dataclass

from nxd_ckpt import resume_state as rank_states
from nxd_ckpt.errors import LayoutMismatchError
from nxd_ckpt.format import layout
from nxd_ckpt.format.describe import TagDescription
from nxd_ckpt.format.metadata import metadata_path
from nxd_ckpt.load import zero1_io
from nxd_ckpt.ranks.topology import Topology


@dataclass(frozen=True)
class ReadPlan:
    """The reads of one rank in a load of ``tag``: which file fills which target (None: no such target)."""

    tag: str
    resharded: bool
    """The TP/PP size changed: model and optimizer are assembled from the parts this rank holds now
    (``load.reshard`` plans those parts); ``model`` and ``optimizer`` are then None."""
    model: str | None
    """The model file read into the live model's tensors."""
    optimizer: str | None
    """The optimizer file read into the live optimizer: this rank's ZeRO-1 shard, or the replicated state of its
    (TP, PP[, EP]) coordinate; with ``zero1_recut`` only the name the state is reported under."""
    zero1_recut: bool
    """ZeRO-1 state saved at another DP size (or merged into full files): read only the rows this shard covers."""
    saved_zero1_dp: int | None
    """The ZeRO-1 DP size on storage (None: not ZeRO-1, or merged full files)."""
    scheduler: str | None
    """The scheduler's file, read into the live scheduler."""
    user_content: str
    """The user content's file, returned when the tag holds one."""
    share_reads: bool
    """DP replicas share the reads of this rank's xser model file (their groups are made before the read): only
    when all replicas of a host load in one wave, as plain files are read by each rank alone."""
    optimizer_shares_reads: bool
    """The optimizer file's reads are shared too (replicated state; a ZeRO-1 shard is this rank's alone)."""


def plan_read(
    tag: str, info: TagDescription, topo: Topology, *, url: str, model: bool, optimizer: bool, scheduler: bool,
    num_workers: int,
) -> ReadPlan:  # fmt: skip
    """This rank's plan (``topo.rank``) for a load of ``tag`` (described by ``info``) filling the targets named
    (``model``, ``optimizer``, ``scheduler``), ``num_workers`` ranks of a host at a time. Raises
    LayoutMismatchError (naming ``url``) for a layout that cannot change on load (``check_layout``)."""
    targets = model or optimizer
    resharded = check_layout(info, topo, url, tag) and targets
    recut, saved_dp = zero1_io.reshard_source(info, topo)
    own = not resharded
    share = targets and info.xser and num_workers >= topo.local_world_size
    return ReadPlan(
        tag=tag,
        resharded=resharded,
        model=model_path(tag, topo, topo.rank) if model and own else None,
        optimizer=optimizer_path(tag, info, topo, topo.rank) if optimizer and own else None,
        zero1_recut=optimizer and own and recut,
        saved_zero1_dp=saved_dp,
        scheduler=layout.tag_path(tag, layout.SCHEDULER_FILE) if scheduler else None,
        user_content=layout.tag_path(tag, layout.USER_CONTENT_FILE),
        share_reads=share,
        optimizer_shares_reads=share and not info.zero1,
    )


def model_path(tag: str, topo: Topology, rank: int) -> str:
    """The model file ``rank`` reads at the saved TP/PP layout: its (TP, PP[, EP]) coordinate's."""
    c = topo.coordinates(rank)
    return layout.model_file(tag, c.tp, c.pp, topo.file_ep_rank_of(rank))


def optimizer_path(tag: str, info: TagDescription, topo: Topology, rank: int) -> str:
    """The optimizer file of ``rank`` at the saved TP/PP layout: its ZeRO-1 shard, or the replicated state of
    its (TP, PP[, EP]) coordinate."""
    c = topo.coordinates(rank)
    if info.zero1:
        return layout.optim_file(tag, topo.zero1_rank_of(rank), c.tp, c.pp)
    return layout.optim_file(tag, 0, c.tp, c.pp, topo.file_ep_rank_of(rank))


def files_read(tag: str, info: TagDescription, topo: Topology, rank: int) -> list[str]:
    """Every file ``rank`` may read in a load of ``tag`` at the saved TP/PP layout (``ReadPlan``); the master
    works these out for every rank to hand each its share of the manifests (``candidates.resolve``). Each path
    stands for its xser parts too (``layout.state_file_of``).

    The model file; the optimizer file, or with ZeRO-1 at another DP size (or merged full files) every ZeRO-1
    file of its (TP, PP) coordinate (``zero1_io.source_paths``: a superset of those holding its rows, which
    depend on each tensor's length); scheduler, user content, metadata; its per-rank state
    (``rank_state.files_read``); with expert parallelism the ``ep_rank_00`` files, whose folders hold the
    non-expert tensors of xser files (``layout.shared_tensors_file``). DP replicas sharing the reads of an xser
    file (``ranks.replicas``) read parts of their own model file: covered."""
    c = topo.coordinates(rank)
    recut, saved_dp = zero1_io.reshard_source(info, topo)
    optim = zero1_io.source_paths(tag, c.tp, c.pp, saved_dp) if recut else [optimizer_path(tag, info, topo, rank)]
    files = [
        model_path(tag, topo, rank),
        *optim,
        layout.tag_path(tag, layout.SCHEDULER_FILE),
        layout.tag_path(tag, layout.USER_CONTENT_FILE),
        metadata_path(tag),
        *rank_states.files_read(tag, rank),
    ]
    return list(dict.fromkeys(files + [layout.shared_tensors_file(path) for path in files]))


def changes_layout(info: TagDescription, topo: Topology) -> bool:
    """Whether a load of ``info`` at ``topo`` is re-sharded (``check_layout``); False for a layout it refuses
    (every rank raises that in ``plan_read``)."""
    try:
        return check_layout(info, topo, "", info.tag)
    except LayoutMismatchError:
        return False


def check_layout(info: TagDescription, topo: Topology, url: str, tag: str) -> bool:
    """Whether the load changes the TP or PP size (re-sharded on load); raises for what cannot change."""
    if info.tp is None:
        return False
    if info.ep != topo.ep_size:
        raise LayoutMismatchError(
            f"checkpoint {url}/{tag} was saved with expert parallelism EP={info.ep} but this job runs "
            f"{topo.describe()}; load it with the same EP size (experts are not re-sharded)"
        )
    if (info.tp, info.pp) != (topo.tp_size, topo.pp_size) and (info.ep > 1 or topo.expert_parallel):
        raise LayoutMismatchError(
            f"checkpoint {url}/{tag} was saved with TP={info.tp} PP={info.pp} EP={info.ep} but this job runs "
            f"{topo.describe()}; re-sharding under expert parallelism is not supported: load it with the same "
            "TP and PP sizes (DP may differ)"
        )
    return (info.tp, info.pp) != (topo.tp_size, topo.pp_size)
