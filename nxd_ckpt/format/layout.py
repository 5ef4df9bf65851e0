"""Pure path builders for the NxD checkpoint tree; the only place that knows file names.

All paths are relative to the checkpoint directory and use "/" separators (they are storage keys too).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from nxd_ckpt.errors import InvalidTagError

CHECKPOINT_MARKER = "checkpoint"
DONE_MARKER = "done"
MODEL_DIR = "model"
OPTIM_DIR = "optim"
SCHEDULER_FILE = "scheduler.pt"
USER_CONTENT_FILE = "user_content.pt"
METADATA_FILE = "nxd_ckpt.json"
"""nxd_ckpt's own per-tag metadata (layout, order, format); NxD ignores it."""
EXTRAS_DIR = "nxd_ckpt"
"""Per-rank extras nxd_ckpt adds (manifests, per-rank state): a folder NxD never looks into."""
DCP_METADATA_FILE = ".metadata"
"""torch Distributed Checkpoint's index, found in ``<tag>/optim`` when NxD saved ZeRO-1 state with use_zero1_dcp."""
HF_INDEX_FILE = "model.safetensors.index.json"
"""A Hugging Face safetensors set's index (``metadata.total_size``, ``weight_map``: tensor name -> file), written last:
the file ``transformers`` opens first and TorchTitan's step scan takes as the mark of a complete ``step-N``."""
HF_SINGLE_FILE = "model.safetensors"
"""A Hugging Face model saved as one file, without an index."""
SAFETENSORS_SUFFIX = ".safetensors"
XSER_TENSORS_SUFFIX = ".tensors"
XSER_INFO_SUFFIX = ".info.pt"

TAG_TOP_LEVEL_FILES = (CHECKPOINT_MARKER, DONE_MARKER, METADATA_FILE, SCHEDULER_FILE, USER_CONTENT_FILE)
"""The files NxD and nxd_ckpt write directly in a tag folder (any other file there belongs to someone else)."""

# optimum-neuron's output directories (docs/optimum-neuron.md): its NxD save goes to these tags, with its
# consolidation metadata beside the state files, and its configuration and scheduler one level up.
OPTIMUM_SHARDS_TAG = "shards"
OPTIMUM_ADAPTER_SHARDS_TAG = "adapter_shards"
OPTIMUM_TRN_CONFIG_FILE = "trn_config.json"
_OPTIMUM_METADATA_RE = re.compile(r"^mp_metadata_pp_rank_(\d+)\.json$")

_TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+=@-]{0,199}$")
_STATE_FILE_RE = re.compile(r"^dp_rank_(\d+)(?:_ep_rank_(\d+))?_tp_rank_(\d+)_pp_rank_(\d+)\.pt$")
_FULL_OPTIM_RE = re.compile(r"^full_tp_rank_(\d+)_pp_rank_(\d+)\.pt$")


def validate_tag(tag: object) -> str:
    """Return ``tag`` if it is a plain directory name, else raise InvalidTagError saying why."""
    if not isinstance(tag, str):
        raise InvalidTagError(f"checkpoint tag must be a string, got {type(tag).__name__} {tag!r}")
    if tag in ("", ".", "..") or "/" in tag or "\\" in tag or not _TAG_RE.match(tag):
        raise InvalidTagError(
            f"invalid checkpoint tag {tag!r}: use a plain name of letters, digits and . _ - + = @ "
            "(at most 200 characters, not starting with a dot), e.g. 'step_1200'"
        )
    return tag


TAG_INDEX_FILE = ".nxd-tags.json"
"""Hidden file at the checkpoint root naming the tags nxd_ckpt committed and their creation times, so ``latest``
needs a few requests, not a few per tag (``tags.latest_tag``). A hint only: NxD neither writes nor reads it (its
loader globs ``*/done``), and a stale or missing one costs requests, never a wrong answer."""
RESAVE_PREFIX = ".nxd-resave."
"""Hidden directory beside a complete tag that is being saved again (NxD's glob and tag listings skip it)."""
REPLACED_PREFIX = ".nxd-replaced."
"""Hidden name the old copy of a re-saved tag has between the swap and its deletion."""
DCP_STAGING_PREFIX = ".nxd-dcp-staging."
"""Hidden directory beside a DCP checkpoint folder where ``nxd_ckpt.dcp.StorageWriter`` writes a save until its
commit renames it into place; the folder's name follows with each ``-`` written ``~`` (``.nxd-dcp-staging.step~100``)
so that no scan for ``step-N`` (TorchTitan's ``re.search``, in its loader and its purge) takes it for a checkpoint."""
DCP_REPLACED_PREFIX = ".nxd-dcp-replaced."
"""Hidden name an older DCP checkpoint has while a save replaces it where directories cannot be exchanged (the
folder's name written as after ``DCP_STAGING_PREFIX``)."""
HIDDEN_DASH = "~"
"""What a ``-`` of a folder's name becomes in the names of its hidden DCP siblings (never in a folder name, so the
name reads back unambiguously)."""
HF_STAGING_PREFIX = ".nxd-hf-staging."
"""Hidden directory beside a ``step-N`` folder where the TorchTitan manager writes its last step in Hugging Face
format until the commit renames it into place (its name written as after ``DCP_STAGING_PREFIX``: ``step~N``)."""
HF_REPLACED_PREFIX = ".nxd-hf-replaced."
"""Hidden name an older Hugging Face folder has while a save replaces it."""


@dataclass(frozen=True)
class CommitLayout:
    """A front end's commit on disk (``save/commit.py`` commits both through it): the file that makes a folder
    complete, written last and deleted first, and the hidden siblings a save is staged in and an old copy waits in."""

    marker: str
    staging_prefix: str
    replaced_prefix: str
    begin_marker: str | None
    """Written first into a staged save (NxD's ``checkpoint``); None: nothing marks a save begun."""
    dated: bool
    """Whether each copy records its creation time (``nxd_ckpt.json``), which tells an old complete copy from its
    re-save after a crash; where it does not, the complete folder always stays and a complete staged copy beside it
    is dropped."""
    own_files: tuple[str, ...] | None
    """The files the front end writes directly in a folder: any other there belongs to someone else and goes with a
    re-saved copy (None: the folder is wholly the front end's, nothing is carried)."""
    kind: str
    """What a complete folder is called in messages."""
    hides_dashes: bool = False
    """Whether the hidden siblings' names write the folder's ``-`` as ``HIDDEN_DASH`` (DCP: see
    ``DCP_STAGING_PREFIX``); the plain names earlier versions wrote are still recognised (``legacy_dirs``)."""

    def _hidden(self, prefix: str, folder: str) -> str:
        name = validate_tag(folder)
        return prefix + (name.replace("-", HIDDEN_DASH) if self.hides_dashes else name)

    def staging_dir(self, folder: str) -> str:
        """Where a save of ``folder`` is written until it is complete and swapped in."""
        return self._hidden(self.staging_prefix, folder)

    def replaced_dir(self, folder: str) -> str:
        """Where the old copy of ``folder`` goes while the staged one takes its name."""
        return self._hidden(self.replaced_prefix, folder)

    def legacy_dirs(self, folder: str) -> tuple[str, str] | None:
        """The staging and replaced names of ``folder`` that versions before ``hides_dashes`` wrote (None where
        they are today's names): recovery and retention still handle what such a version left."""
        name = validate_tag(folder)
        if not self.hides_dashes or "-" not in name:
            return None
        return self.staging_prefix + name, self.replaced_prefix + name

    def folder_of(self, name: str) -> str | None:
        """The folder whose hidden sibling (staging or replaced, today's name or a legacy one) is called ``name``;
        None for any other name."""
        for prefix in (self.staging_prefix, self.replaced_prefix):
            if name.startswith(prefix):
                folder = name[len(prefix) :].replace(HIDDEN_DASH, "-") if self.hides_dashes else name[len(prefix) :]
                try:
                    return validate_tag(folder)
                except InvalidTagError:
                    return None
        return None


NXD_COMMIT = CommitLayout(
    DONE_MARKER, RESAVE_PREFIX, REPLACED_PREFIX, CHECKPOINT_MARKER, True, TAG_TOP_LEVEL_FILES, "tag"
)
"""NxD tags: ``done`` last; a new tag is written in place, a re-save of a complete one beside it."""
DCP_COMMIT = CommitLayout(
    DCP_METADATA_FILE, DCP_STAGING_PREFIX, DCP_REPLACED_PREFIX, None, False, None, "DCP checkpoint", hides_dashes=True
)
"""DCP checkpoint folders: ``.metadata`` last; every save staged where the storage renames directories."""
HF_COMMIT = CommitLayout(
    HF_INDEX_FILE,
    HF_STAGING_PREFIX,
    HF_REPLACED_PREFIX,
    None,
    False,
    None,
    "Hugging Face checkpoint",
    hides_dashes=True,
)
"""Hugging Face safetensors folders: the index last; every save staged where the storage renames directories."""


def resave_dir(tag: str) -> str:
    """Where a re-save of the complete tag ``tag`` is written until it is complete and swapped in."""
    return NXD_COMMIT.staging_dir(tag)


def replaced_dir(tag: str) -> str:
    """Where the old copy of ``tag`` goes while the re-saved one takes its name."""
    return NXD_COMMIT.replaced_dir(tag)


def tag_path(tag: str, *parts: str) -> str:
    return "/".join((validate_tag(tag), *parts))


def state_file_name(dp: int, tp: int, pp: int, ep: int | None = None) -> str:
    """NxD's state file name; ``ep`` (the expert-parallel rank) is part of it only with expert parallelism."""
    ep_part = "" if ep is None else f"_ep_rank_{ep:02d}"
    return f"dp_rank_{dp:02d}{ep_part}_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt"


def model_file(tag: str, tp: int, pp: int, ep: int | None = None) -> str:
    """Model state of a (TP, PP[, EP]) coordinate; always named with DP rank 0."""
    return tag_path(tag, MODEL_DIR, state_file_name(0, tp, pp, ep))


def optim_file(tag: str, dp: int, tp: int, pp: int, ep: int | None = None) -> str:
    """Optimizer state: ``dp`` is the DP rank for ZeRO-1 shards and 0 for replicated optimizers; ``ep`` is given
    for replicated optimizers under expert parallelism (NxD names ZeRO-1 shards without it)."""
    return tag_path(tag, OPTIM_DIR, state_file_name(dp, tp, pp, ep))


def shared_tensors_file(path: str) -> str:
    """Where NxD's xser loads read a non-expert tensor file of ``path``'s: the ``ep_rank_00`` file's tensors
    (NxD writes non-expert tensors only there). Paths without an EP rank are returned unchanged."""
    head, _, name = path.rpartition("/")
    m = _STATE_FILE_RE.match(name)
    if not m or m.group(2) is None:
        return path
    dp, _, tp, pp = m.groups()
    return (
        f"{head}/{state_file_name(int(dp), int(tp), int(pp), 0)}"
        if head
        else state_file_name(int(dp), int(tp), int(pp), 0)
    )


def full_optim_file(tag: str, tp: int, pp: int) -> str:
    """Merged (unsharded) ZeRO-1 optimizer state written by the offline converter."""
    return tag_path(tag, OPTIM_DIR, f"full_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt")


def parse_state_file_name(name: str) -> tuple[int, int, int] | None:
    """(dp, tp, pp) from ``dp_rank_XX[_ep_rank_EE]_tp_rank_YY_pp_rank_ZZ.pt``, or None for other names."""
    m = _STATE_FILE_RE.match(name)
    return (int(m.group(1)), int(m.group(3)), int(m.group(4))) if m else None


def parse_expert_rank(name: str) -> int | None:
    """The EP rank of an expert-parallel state file name (``..._ep_rank_EE_...``), else None."""
    m = _STATE_FILE_RE.match(name)
    return int(m.group(2)) if m and m.group(2) is not None else None


def parse_full_optim_file_name(name: str) -> tuple[int, int] | None:
    """(tp, pp) from ``full_tp_rank_YY_pp_rank_ZZ.pt``, or None."""
    m = _FULL_OPTIM_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def xser_tensors_dir(path: str) -> str:
    return path + XSER_TENSORS_SUFFIX


def is_xser_file(storage: Any, path: str) -> bool:
    """A state file is xser when its ``<path>.tensors`` directory exists (``storage``: a ``Storage``)."""
    return bool(storage.list_dir(xser_tensors_dir(path)))


def xser_tensor_file(path: str, tid: int) -> str:
    return f"{path}{XSER_TENSORS_SUFFIX}/tensor_{tid}.pt"


def xser_info_file(path: str) -> str:
    return path + XSER_INFO_SUFFIX


def state_file_of(path: str) -> str:
    """The state file whose part ``path`` is: ``X`` for ``X``, for its xser info file ``X.info.pt`` and for its
    tensor files ``X.tensors/tensor_N.pt``; any other path is its own (works on paths within a tag too)."""
    head, sep, _ = path.partition(XSER_TENSORS_SUFFIX + "/")
    if sep:
        return head
    return path.removesuffix(XSER_INFO_SUFFIX) if path.endswith(".pt" + XSER_INFO_SUFFIX) else path


def manifest_file(tag: str, rank: int) -> str:
    return tag_path(tag, EXTRAS_DIR, f"manifest_rank_{rank:05d}.json")


def dcp_index_file(folder: str) -> str:
    """A DCP checkpoint's combined index: every rank's file records (and ``.metadata``'s), written once by the
    coordinator at the commit, so a load plans from one file instead of one manifest per rank."""
    return tag_path(folder, EXTRAS_DIR, "dcp_index.json")


def dcp_metadata_record_file(folder: str) -> str:
    """A DCP checkpoint's record (size and digest) of its ``.metadata``, at a fixed place (no listing), written by
    the coordinator with the commit: every rank checks ``.metadata`` against it before unpickling it."""
    return tag_path(folder, EXTRAS_DIR, "dcp_metadata.json")


def rank_state_file(tag: str, rank: int) -> str:
    return tag_path(tag, EXTRAS_DIR, f"rank_state_{rank:05d}.pt")


def gathered_rank_states_file(tag: str) -> str:
    """Every rank's per-rank state in one file, written by the master (the gather-to-master pattern)."""
    return tag_path(tag, EXTRAS_DIR, "rank_states.pt")


# --------------------------------------------------------------------------------------------- the memory tier
MEMORY_SHARE_PREFIX = "node_"
"""A node's memory directory holds one folder per share: ``node_NNNNN`` holds what node NNNNN's ranks wrote."""
TIER_MARKER_PREFIX = "tier_rank_"
_SHARE_RE = re.compile(r"^node_(\d{5})$")
_TIER_MARKER_RE = re.compile(r"^tier_rank_(\d{5})\.json$")


def memory_share_dir(node: int) -> str:
    return f"{MEMORY_SHARE_PREFIX}{node:05d}"


def parse_memory_share_dir(name: str) -> int | None:
    m = _SHARE_RE.match(name)
    return int(m.group(1)) if m else None


def tier_marker_file(tag: str, rank: int) -> str:
    """Written last, after a rank's files and manifest, in every memory-tier copy of them: that copy is complete."""
    return tag_path(tag, EXTRAS_DIR, f"{TIER_MARKER_PREFIX}{rank:05d}.json")


def parse_tier_marker_name(name: str) -> int | None:
    m = _TIER_MARKER_RE.match(name)
    return int(m.group(1)) if m else None


def optimum_metadata_file(tag: str, pp: int) -> str:
    """optimum-neuron's consolidation metadata of PP stage ``pp`` (``save_pretrained`` writes it into the tag)."""
    return tag_path(tag, f"mp_metadata_pp_rank_{pp}.json")


def parse_optimum_metadata_name(name: str) -> int | None:
    """The PP stage of an optimum-neuron metadata file name, else None."""
    m = _OPTIMUM_METADATA_RE.match(name)
    return int(m.group(1)) if m else None
