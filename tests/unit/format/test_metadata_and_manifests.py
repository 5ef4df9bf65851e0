"""The on-disk metadata and manifests, pinned byte for byte, read tolerantly; one description of a tag and one
list of the files it must hold (format/)."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

import nxd_ckpt as nxd
from nxd_ckpt.errors import FormatError, IntegrityError
from nxd_ckpt.format import layout, manifests
from nxd_ckpt.format.describe import describe, expected_files
from nxd_ckpt.format.hashing import hash_bytes
from nxd_ckpt.format.metadata import TagMetadata, read_metadata
from nxd_ckpt.format.sharding import ShardingRecord, TensorSharding
from nxd_ckpt.storage import LocalStorage

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

GOLDEN_METADATA = b"""{
 "format": "nxd_ckpt",
 "format_version": 1,
 "tag": "step_1200",
 "created_at": 1795000000.123,
 "layout": {
  "tp": 2,
  "pp": 1,
  "dp": 4,
  "world_size": 8
 },
 "zero1": true,
 "zero1_dp_size": 4,
 "xser": true,
 "items": [
  "model",
  "optimizer",
  "scheduler",
  "user_content"
 ],
 "torch_version": "2.9.0"
}"""

GOLDEN_MANIFEST = (
    b'{\n"format": "nxd_ckpt.manifest",\n"format_version": 1,\n"algorithm": "xxh3_64",\n"tag": "step_1200",\n'
    b'"rank": 3,\n"checksum": "f8590cdf8441248d",\n"files": {\n'
    b'  "model/dp_rank_00_tp_rank_01_pp_rank_00.pt": [1048576, "9c1f00aa11bb22cc"],\n'
    b'  "nxd_ckpt.json": [300, "0123456789abcdef"]\n}\n}\n'
)

SAVED = TagMetadata(
    tag="step_1200",
    created_at=1795000000.123,
    tp=2,
    pp=1,
    dp=4,
    world_size=8,
    zero1=True,
    zero1_dp_size=4,
    xser=True,
    items=("model", "optimizer", "scheduler", "user_content"),
    torch_version="2.9.0",
)


def test_metadata_golden_bytes():
    assert SAVED.to_json() == GOLDEN_METADATA
    assert TagMetadata.from_json(GOLDEN_METADATA) == SAVED


def test_metadata_records_context_and_expert_parallel_sizes_in_the_layout():
    meta = SAVED.with_changes(cp=2, ep=4)
    golden = GOLDEN_METADATA.replace(b'  "dp": 4,\n', b'  "dp": 4,\n  "cp": 2,\n  "ep": 4,\n')
    assert meta.to_json() == golden
    assert TagMetadata.from_json(golden) == meta


def test_metadata_records_whether_the_save_was_asynchronous_after_the_other_keys():
    for saved_async in (True, False):
        meta = SAVED.with_changes(saved_async=saved_async)
        golden = GOLDEN_METADATA[:-2] + f',\n "async_save": {str(saved_async).lower()}\n}}'.encode()
        assert meta.to_json() == golden
        assert TagMetadata.from_json(golden) == meta
    assert TagMetadata.from_json(GOLDEN_METADATA).saved_async is None  # not recorded: unchanged bytes, None


def test_metadata_records_the_sharding_after_the_other_keys():
    record = ShardingRecord(
        {"qkv.weight": TensorSharding((12, 4), 0, 3, 2, 0), "norm.weight": TensorSharding((4,), pp_stage=0)},
        {0: ("qkv.weight", "norm.weight")},
    )
    meta = SAVED.with_changes(sharding=record)
    golden = GOLDEN_METADATA[:-2] + (
        b',\n "sharding": {\n  "tensors": {\n   "qkv.weight": {\n    "shape": [\n     12,\n     4\n    ],\n'
        b'    "dim": 0,\n    "stride": 3,\n    "partitions": 2,\n    "pp": 0\n   },\n   "norm.weight": {\n'
        b'    "shape": [\n     4\n    ],\n    "pp": 0\n   }\n  },\n  "optimizer_params": {\n   "0": [\n'
        b'    "qkv.weight",\n    "norm.weight"\n   ]\n  }\n }\n}'
    )
    assert meta.to_json() == golden
    assert TagMetadata.from_json(golden) == meta
    assert TagMetadata.from_json(GOLDEN_METADATA).sharding is None  # tags without it: unchanged bytes, None
    with pytest.raises(FormatError, match="sharding"):
        TagMetadata.from_json(GOLDEN_METADATA[:-2] + b', "sharding": {"tensors": {"w": {"dim": 0}}}}')


def test_manifest_golden_bytes():
    records = {
        "model/dp_rank_00_tp_rank_01_pp_rank_00.pt": manifests.FileRecord(1048576, "9c1f00aa11bb22cc", 3),
        "nxd_ckpt.json": manifests.FileRecord(300, "0123456789abcdef", 3),
    }
    assert manifests.manifest_bytes("step_1200", 3, records) == GOLDEN_MANIFEST
    assert manifests.parse_manifest(GOLDEN_MANIFEST, "m") == (3, records)


def test_block_digests_cut_every_block_and_at_each_item_and_round_trip():
    data = bytes(range(256)) * 4096  # 1 MiB
    hasher = manifests.BlockHasher()
    hasher.update(data[:300_000])  # one full block (256 KiB), then 37,856 bytes
    hasher.cut()  # an item starts at 300,000: its first block is HEAD_BYTES long
    hasher.update(data[300_000:])
    rec = hasher.record(5)
    block, head = manifests.BLOCK_BYTES, manifests.HEAD_BYTES
    ends = [block, 300_000, 300_000 + head, 300_000 + head + block, 300_000 + head + 2 * block, len(data)]
    assert [e for e, _ in rec.blocks] == ends
    assert (rec.size, rec.digest) == hash_bytes(data)  # the whole file's digest stays
    starts = [0, *ends[:-1]]
    assert [d for _, d in rec.blocks] == [hash_bytes(data[a:b])[1] for a, b in zip(starts, ends, strict=True)]
    assert manifests.record_bytes(data[:300_000], 5).blocks == ((block, rec.blocks[0][1]), (300_000, rec.blocks[1][1]))
    assert rec.blocks_over(299_999, 300_001) == [
        (block, 300_000, rec.blocks[1][1]),
        (300_000, ends[2], rec.blocks[2][1]),
    ]
    data_v2 = manifests.manifest_bytes("t", 5, {"a.pt": rec})
    assert json.loads(data_v2)["format_version"] == 2
    assert manifests.parse_manifest(data_v2, "m") == (5, {"a.pt": rec})


def test_malformed_block_records_are_damage_and_a_newer_version_is_named():
    rec = manifests.record_bytes(b"x" * 1000, 0)
    doc = json.loads(manifests.manifest_bytes("t", 0, {"a.pt": rec}))
    doc["files"]["a.pt"][2] = [[500, "00"], [400, "11"]]  # out of order
    doc.pop("checksum")
    doc["checksum"] = hash_bytes(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())[1]
    with pytest.raises(IntegrityError, match="block records do not cover the file"):
        manifests.parse_manifest(json.dumps(doc).encode(), "m")
    doc["format_version"] = 3
    doc["files"]["a.pt"][2] = [[1000, rec.digest]]
    doc.pop("checksum")
    doc["checksum"] = hash_bytes(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())[1]
    with pytest.raises(IntegrityError, match="newer than this nxd_ckpt reads"):
        manifests.parse_manifest(json.dumps(doc).encode(), "m")


def test_saved_metadata_is_written_through_the_type(tmp_path):
    """A real save's nxd_ckpt.json is exactly TagMetadata's bytes (nothing else writes the file)."""
    nxd.save_checkpoint(str(tmp_path), "t1", model=torch.nn.Linear(2, 2), user_content={"step": 1})
    nxd.finalize_checkpoint()
    data = (tmp_path / "t1" / layout.METADATA_FILE).read_bytes()
    meta = TagMetadata.from_json(data)
    assert meta.to_json() == data and not meta.extra
    assert (meta.tp, meta.pp, meta.dp, meta.world_size, meta.zero1, meta.zero1_dp_size) == (1, 1, 1, 1, False, None)
    assert meta.items == ("model", "user_content") and meta.zero1_full is None


def test_metadata_crosses_ranks():
    """Descriptions are broadcast to every rank: the type pickles, and stays immutable."""
    import pickle

    meta = SAVED.with_changes(converted_from={"tag": "a", "zero1_dp_size": 4}, extra={"k": [1]})
    assert pickle.loads(pickle.dumps(meta)) == meta
    with pytest.raises(TypeError, match="immutable"):
        meta.extra["k"] = 2  # type: ignore[index]


def test_older_and_newer_files_are_read():
    old = TagMetadata.from_json(b'{"format": "nxd_ckpt", "tag": "a", "zero1": true}')
    assert (old.tp, old.zero1, old.zero1_dp_size, old.created_at, old.items) == (None, True, None, None, ())
    assert old.expected_manifest_ranks is None
    newer = dict(json.loads(GOLDEN_METADATA), format_version=7, future_key={"x": 1})
    meta = TagMetadata.from_dict(newer)
    assert meta.format_version == 7 and dict(meta.extra) == {"future_key": {"x": 1}}
    assert json.loads(meta.to_json()) == newer  # unknown keys survive a rewrite


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"format": "other"}', "'format'"),
        (b'{"layout": {"tp": "two"}}', "two"),
        (b'{"items": "model"}', "items"),
    ],
)
def test_bad_metadata_is_named(data, match):
    with pytest.raises(FormatError, match=match):
        TagMetadata.from_json(data, "x/nxd_ckpt.json")


def test_every_key_is_documented():
    """docs/format.md names every key the type reads or writes."""
    with open(os.path.join(REPO, "docs", "format.md")) as f:
        doc = f.read()
    section = doc[doc.index("## `<tag>/nxd_ckpt.json`") : doc.index("## `<tag>/nxd_ckpt/manifest_rank")]
    keys = (
        set(SAVED.to_dict())
        | set(SAVED.to_dict()["layout"])
        | {"zero1_full", "converted_from", "manifest_ranks", "sharding", "async_save"}
    )
    missing = [k for k in sorted(keys) if not re.search(rf"`{k}`", section)]
    assert not missing, f"docs/format.md does not document {missing}"


def test_no_module_reads_metadata_keys_but_the_owner():
    """Raw reads of nxd_ckpt.json keys happen in format/metadata.py only."""
    pattern = re.compile(
        r"""(meta|metadata|info)(\.get\(|\[)["'](zero1|zero1_dp_size|zero1_full|layout|items|created_at)"""
    )
    offenders = []
    for root, _, files in os.walk(os.path.join(REPO, "nxd_ckpt")):
        for name in files:
            path = os.path.join(root, name)
            if name.endswith(".py") and not path.endswith(os.path.join("format", "metadata.py")):
                with open(path) as f:
                    if pattern.search(f.read()):
                        offenders.append(os.path.relpath(path, REPO))
    assert not offenders


# --------------------------------------------------------------------------------------------- describe


def _nxd_tag(root, tp=2, dp=1, zero1_full=False):
    tag = root / "step_5"
    (tag / "model").mkdir(parents=True)
    (tag / "optim").mkdir()
    for t in range(tp):
        torch.save({"w": torch.ones(2)}, tag / "model" / layout.state_file_name(0, t, 0))
        if zero1_full:
            torch.save({"s": 1}, tag / "optim" / f"full_tp_rank_{t:02d}_pp_rank_00.pt")
        for d in range(0 if zero1_full else dp):
            torch.save({"s": 1}, tag / "optim" / layout.state_file_name(d, t, 0))
    (tag / "done").write_text("1")
    return LocalStorage(root)


def test_describe_from_names_and_expected_files(tmp_path):
    storage = _nxd_tag(tmp_path / "a", tp=2, dp=3)
    desc = describe(storage, "step_5")
    assert (desc.tp, desc.pp, desc.dp, desc.zero1_kind, desc.metadata) == (2, 1, 3, "sharded", None)
    assert desc.text() == "DP=3 TP=2 PP=1, ZeRO-1"
    assert len(expected_files(desc)) == 2 + 6
    full = describe(_nxd_tag(tmp_path / "b", tp=2, zero1_full=True), "step_5")
    assert (full.dp, full.zero1_kind, full.zero1_dp_size) == (None, "full", None)
    assert full.text() == "DP=any TP=2 PP=1, ZeRO-1 (full)"
    assert "optim/full_tp_rank_01_pp_rank_00.pt" in expected_files(full)


def test_metadata_wins_over_names(tmp_path):
    storage = _nxd_tag(tmp_path, tp=1, dp=1)
    meta = SAVED.with_changes(tag="step_5", tp=1, dp=2, world_size=2, zero1_dp_size=2, xser=False)
    storage.write_bytes("step_5/nxd_ckpt.json", meta.to_json())
    desc = describe(storage, "step_5")
    assert read_metadata(storage, "step_5") == meta == desc.metadata
    assert (desc.dp, desc.zero1_dp_size, desc.zero1_kind) == (2, 2, "sharded")
    assert "optim/dp_rank_01_tp_rank_00_pp_rank_00.pt" in expected_files(desc)  # missing: verify reports it


def test_one_manifest_reader_for_load_and_verify(tmp_path):
    """A rank's manifest missing: the load path raises, verify lists the same problem."""
    nxd.save_checkpoint(str(tmp_path), "t1", model=torch.nn.Linear(2, 2))
    nxd.finalize_checkpoint()
    storage = LocalStorage(tmp_path)
    meta = read_metadata(storage, "t1")
    assert meta is not None
    found = manifests.read_manifests(storage, "t1")
    assert found.ranks == {0} and not found.problems and found.metadata == meta
    # claim a second writer: its manifest is then missing, for both readers
    records = found.index
    storage.write_bytes("t1/nxd_ckpt.json", meta.with_changes(manifest_ranks=2).to_json())
    records = {**records, "nxd_ckpt.json": manifests.FileRecord(*hash_bytes(storage.read_bytes("t1/nxd_ckpt.json")), 0)}
    manifests.write_manifest(storage, "t1", 0, records)
    with pytest.raises(IntegrityError, match="manifest_rank_00001.json is missing"):
        manifests.read_index(storage, "t1")
    report = nxd.verify(str(tmp_path), "t1")
    assert not report.ok and any("manifest_rank_00001.json is missing" in p for p in report.problems)
