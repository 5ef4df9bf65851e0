"""Checksums and manifests (nxd_ckpt.format.integrity), verify(), verified loads and the fall back to an intact tag."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os

import pytest
import torch

import nxd_ckpt as nxd
from nxd_ckpt.errors import FormatError, IntegrityError
from nxd_ckpt.format import hashing, integrity, layout
from nxd_ckpt.storage import LocalStorage
from nxd_ckpt.testing.fakes import assert_state_equal, make_training, train_steps
from nxd_ckpt.tools import verification


def _save(ckpt: str, tag: str, seed: int, use_xser: bool = False) -> dict:
    model, opt, sched = make_training(seed=seed)
    train_steps(model, opt, sched, steps=2, seed=seed)
    nxd.save_checkpoint(
        ckpt, tag, model=model, optimizer=opt, scheduler=sched, user_content={"seed": seed}, use_xser=use_xser
    )
    return model.state_dict()


def _tensor_data_offset(path: str) -> int:
    """Where the first tensor's bytes start inside a torch.save zip archive."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith("/data/0"))
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len


def _flip(path: str, offset: int | None = None) -> None:
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        i = len(data) // 2 if offset is None else offset
        data[i] ^= 0x01
        f.seek(0)
        f.write(data)


def test_checksumming_storage_records_what_streams_through(tmp_path):
    store = integrity.ChecksummingStorage(LocalStorage(tmp_path), "t1", rank=3)
    with store.open_write("t1/a/b.bin") as f:
        f.write(b"hello ")
        f.write(memoryview(b"world"))
    store.write_bytes("t1/c.bin", b"x" * 100)
    store.write_bytes("elsewhere.bin", b"not part of the tag")
    with pytest.raises(RuntimeError), store.open_write("t1/failed.bin") as f:
        f.write(b"partial")
        raise RuntimeError("writer died")
    hello, x100 = integrity.hash_bytes(b"hello world")[1], integrity.hash_bytes(b"x" * 100)[1]
    assert store.records == {  # one block each: its digest is the whole file's
        "a/b.bin": integrity.FileRecord(11, hello, 3, ((11, hello),)),
        "c.bin": integrity.FileRecord(100, x100, 3, ((100, x100),)),
    }
    path = store.write_manifest()
    assert path == "t1/nxd_ckpt/manifest_rank_00003.json"
    assert integrity.read_index(LocalStorage(tmp_path), "t1") == store.records


def test_hashing_writer_refuses_seek_and_fileno(tmp_path):
    """Writers that rewrite bytes or bypass write() would record a wrong checksum: they fail at save time."""
    store = integrity.ChecksummingStorage(LocalStorage(tmp_path), "t1", rank=0)
    with pytest.raises(AttributeError), store.open_write("t1/x.bin") as f:
        f.seek(0)
    with pytest.raises(AttributeError), store.open_write("t1/y.bin") as f:
        f.fileno()
    assert store.records == {}


def test_manifest_seals_itself(tmp_path):
    data = integrity.manifest_bytes("t1", 0, {"model/a.pt": integrity.FileRecord(10, "00ff", 0)})
    assert integrity.parse_manifest(data, "m")[1]["model/a.pt"].size == 10
    tampered = data.replace(b"[10,", b"[11,")
    assert tampered != data
    with pytest.raises(IntegrityError, match="manifest m is damaged.*own checksum"):
        integrity.parse_manifest(tampered, "m")
    with pytest.raises(IntegrityError, match="manifest m is damaged"):
        integrity.parse_manifest(data[: len(data) // 2], "m")


def test_verifying_storage_names_the_damaged_file(tmp_path):
    store = integrity.ChecksummingStorage(LocalStorage(tmp_path), "t1", rank=0)
    store.write_bytes("t1/model/a.pt", b"A" * 1000)
    store.write_manifest()
    reader = integrity.VerifyingStorage(LocalStorage(tmp_path), "t1")
    with reader.open_read("t1/model/a.pt") as f:
        assert f.read() == b"A" * 1000  # the stream is rewound after hashing
    assert reader.files_verified == 1 and reader.bytes_verified == 1000
    _flip(str(tmp_path / "t1/model/a.pt"))
    with (
        pytest.raises(IntegrityError, match=r"t1/model/a\.pt is corrupt: it has xxh3_64 checksum"),
        reader.open_read("t1/model/a.pt"),
    ):
        pass
    with pytest.raises(IntegrityError, match=r"t1/model/a\.pt is corrupt"):
        reader.read_bytes("t1/model/a.pt")
    os.truncate(tmp_path / "t1/model/a.pt", 10)
    with pytest.raises(IntegrityError, match=r"a\.pt is corrupt: it has 10 bytes but 1000 were written"):
        reader.read_bytes("t1/model/a.pt")


def test_save_writes_manifests_and_verify_passes(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _save(ckpt, "step_1", seed=1)
    manifest = json.loads((tmp_path / "ckpt/step_1/nxd_ckpt/manifest_rank_00000.json").read_bytes())
    assert set(manifest["files"]) == {
        "model/dp_rank_00_tp_rank_00_pp_rank_00.pt",
        "optim/dp_rank_00_tp_rank_00_pp_rank_00.pt",
        "scheduler.pt",
        "user_content.pt",
        "nxd_ckpt.json",
    }
    report = nxd.verify(ckpt)
    assert report.ok, report.summary()
    assert report.tag == "step_1" and report.complete and report.manifests == 1 and report.files_checked == 5
    assert verification.verify(ckpt).raise_if_failed().ok


def test_resave_over_a_tag_drops_stale_manifests(tmp_path):
    ckpt = tmp_path / "ckpt"
    _save(str(ckpt), "step_1", seed=1)
    stale = ckpt / "step_1/nxd_ckpt/manifest_rank_00007.json"  # as if a bigger world had saved this tag before
    stale.write_bytes(integrity.manifest_bytes("step_1", 7, {"gone.pt": integrity.FileRecord(1, "00", 7)}))
    _save(str(ckpt), "step_1", seed=2)
    assert not stale.exists()
    assert nxd.verify(str(ckpt)).ok


def test_verify_reports_every_problem_by_file(tmp_path):
    ckpt = tmp_path / "ckpt"
    _save(str(ckpt), "step_1", seed=1)
    _flip(str(ckpt / "step_1/optim/dp_rank_00_tp_rank_00_pp_rank_00.pt"))
    (ckpt / "step_1/scheduler.pt").unlink()
    report = nxd.verify(str(ckpt), "step_1")
    assert not report.ok
    text = "\n".join(report.problems)
    assert "step_1/optim/dp_rank_00_tp_rank_00_pp_rank_00.pt is corrupt" in text
    assert "step_1/scheduler.pt is missing" in text
    with pytest.raises(IntegrityError, match="scheduler.pt is missing"):
        report.raise_if_failed()
    with pytest.raises(IntegrityError, match="optim/dp_rank_00_tp_rank_00_pp_rank_00.pt is corrupt"):
        verification.verify(str(ckpt), "step_1").raise_if_failed()


def test_verify_without_manifests_checks_structure(tmp_path):
    """NxD-written tags have no manifests: zip CRCs and the pickle structure are checked, nothing is executed."""
    tag = tmp_path / "ckpt" / "nxd_tag"
    (tag / "model").mkdir(parents=True)
    torch.save({"w": torch.arange(1000.0)}, tag / "model/dp_rank_00_tp_rank_00_pp_rank_00.pt")
    torch.save({"args": __import__("argparse").Namespace(lr=1)}, tag / "user_content.pt")
    (tag / "checkpoint").write_text("1")
    (tag / "done").write_text("1")
    report = nxd.verify(str(tmp_path / "ckpt"))
    assert report.ok and report.manifests == 0 and report.files_checked == 2, report.summary()
    assert any("argparse.Namespace" in n and "allow_pickle=True" in n for n in report.notes)
    path = tag / "model/dp_rank_00_tp_rank_00_pp_rank_00.pt"
    _flip(str(path), _tensor_data_offset(str(path)) + 8)
    report = nxd.verify(str(tmp_path / "ckpt"))
    assert [p for p in report.problems if "model/dp_rank_00_tp_rank_00_pp_rank_00.pt is damaged" in p]


def test_verify_flags_a_missing_rank_manifest(tmp_path):
    ckpt = tmp_path / "ckpt"
    _save(str(ckpt), "step_1", seed=1)
    meta_path = ckpt / "step_1/nxd_ckpt.json"
    meta = json.loads(meta_path.read_bytes())
    meta["layout"]["world_size"] = 2  # as if rank 1's manifest had been lost
    meta_path.write_text(json.dumps(meta))
    _reseal(ckpt / "step_1")
    report = nxd.verify(str(ckpt))
    assert any("manifest_rank_00001.json is missing" in p for p in report.problems), report.summary()
    with pytest.raises(IntegrityError, match="manifest_rank_00001.json is missing"):
        nxd.load_checkpoint(str(ckpt))


def _reseal(tag_dir) -> None:
    """Recompute every manifest entry from the files as they are now (what an attacker with write access does)."""
    store = LocalStorage(tag_dir.parent)
    for path in integrity.manifest_paths(store, tag_dir.name):
        rank, records = integrity.parse_manifest(store.read_bytes(path), path)
        fresh = {
            rel: integrity.FileRecord(*integrity.hash_bytes((tag_dir / rel).read_bytes()), rank) for rel in records
        }
        store.write_bytes(path, integrity.manifest_bytes(tag_dir.name, rank, fresh))


def test_load_verifies_by_default_and_can_skip_it(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    saved = _save(ckpt, "step_1", seed=1)
    model, _, _ = make_training(seed=5)
    state = model.state_dict()
    path = os.path.join(ckpt, "step_1/model/dp_rank_00_tp_rank_00_pp_rank_00.pt")
    _flip(path, _tensor_data_offset(path) + 2)  # one bit of one weight: torch.load does not notice
    with pytest.raises(IntegrityError, match=r"step_1/model/dp_rank_00_tp_rank_00_pp_rank_00\.pt is corrupt"):
        nxd.load_checkpoint(ckpt, model=state)
    nxd.load_checkpoint(ckpt, model=state, verify=False)
    with pytest.raises(AssertionError, match="tensor values differ"):  # silently wrong without verification
        assert_state_equal(state, saved)


def test_fallback_loads_the_newest_intact_tag_and_warns(tmp_path, caplog):
    ckpt = str(tmp_path / "ckpt")
    saved1 = _save(ckpt, "step_1", seed=1)
    _save(ckpt, "step_2", seed=2)
    _save(ckpt, "step_3", seed=3)
    _flip(os.path.join(ckpt, "step_3/model/dp_rank_00_tp_rank_00_pp_rank_00.pt"))
    os.truncate(os.path.join(ckpt, "step_2/user_content.pt"), 100)
    model, _, _ = make_training(seed=9)
    with pytest.raises(IntegrityError, match="step_3/model/dp_rank_00_tp_rank_00_pp_rank_00.pt is corrupt"):
        nxd.load_checkpoint(ckpt, model=model)
    with caplog.at_level(logging.WARNING, logger="nxd_ckpt"):
        content = nxd.load_checkpoint(ckpt, model=model, fallback_to_verified=True)
    assert content == {"seed": 1}
    assert_state_equal(model.state_dict(), saved1)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("step_3" in w and "FAILED VERIFICATION" in w for w in warnings), warnings
    assert any("step_2" in w and "user_content.pt" in w for w in warnings), warnings
    _flip(os.path.join(ckpt, "step_1/nxd_ckpt.json"))
    with pytest.raises(IntegrityError, match="no complete checkpoint in .* passes verification"):
        nxd.load_checkpoint(ckpt, model=model, fallback_to_verified=True)


def test_fallback_does_not_hide_other_errors(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _save(ckpt, "step_1", seed=1)
    with pytest.raises(nxd.StateMismatchError):
        nxd.load_checkpoint(ckpt, model=torch.nn.Linear(2, 2), fallback_to_verified=True)


def test_tags_without_manifests_load_unverified(tmp_path):
    """Checkpoints from before manifests existed (or from NxD) load as before."""
    ckpt = tmp_path / "ckpt"
    saved = _save(str(ckpt), "step_1", seed=1)
    for p in (ckpt / "step_1/nxd_ckpt").iterdir():
        p.unlink()
    model, _, _ = make_training(seed=4)
    assert nxd.load_checkpoint(str(ckpt), model=model) == {"seed": 1}
    assert_state_equal(model.state_dict(), saved)


def test_scan_torch_file_reads_globals_without_running_them():
    buf = io.BytesIO()
    torch.save({"t": torch.ones(3), "ns": __import__("argparse").Namespace(a=1)}, buf)
    buf.seek(0)
    from nxd_ckpt.tools.verification import scan_torch_file

    names = scan_torch_file(buf)
    assert "argparse.Namespace" in names and "torch._utils._rebuild_tensor_v2" in names
    with pytest.raises(FormatError):
        scan_torch_file(io.BytesIO(buf.getvalue()[:-40]))


def test_manifest_paths_are_per_rank(tmp_path):
    assert layout.manifest_file("step_1", 12) == "step_1/nxd_ckpt/manifest_rank_00012.json"


def test_a_manifest_cannot_point_outside_its_tag(tmp_path):
    ckpt = tmp_path / "ckpt"
    _save(str(ckpt), "step_1", seed=1)
    (tmp_path / "secret").write_bytes(b"outside")
    store = LocalStorage(ckpt)
    hostile = {"../../secret": integrity.FileRecord(7, integrity.hash_bytes(b"outside")[1], 0)}
    store.write_bytes(layout.manifest_file("step_1", 0), integrity.manifest_bytes("step_1", 0, hostile))
    with pytest.raises(IntegrityError, match="manifest_rank_00000.json is damaged"):
        integrity.read_index(store, "step_1")
    report = nxd.verify(str(ckpt))
    assert any("manifest_rank_00000.json is damaged" in p for p in report.problems), report.summary()


def test_nxd_tag_with_a_deleted_model_file_fails_in_python_and_cli(tmp_path):
    """One verdict: nxd_ckpt.verify() and ``nxd-ckpt verify`` run the same checks (format.describe's files)."""
    from nxd_ckpt import cli

    tag = tmp_path / "ckpt" / "step_4"
    (tag / "model").mkdir(parents=True)
    for tp in range(2):
        torch.save({"w": torch.ones(3) * tp}, tag / "model" / layout.state_file_name(0, tp, 0))
    (tag / "done").write_text("1")
    assert nxd.verify(str(tmp_path / "ckpt")).ok and cli.main(["verify", str(tmp_path / "ckpt")]) == 0
    (tag / "model" / layout.state_file_name(0, 0, 0)).unlink()
    report = nxd.verify(str(tmp_path / "ckpt"))
    assert not report.ok and any(layout.state_file_name(0, 0, 0) in p for p in report.problems), report.summary()
    assert cli.main(["verify", str(tmp_path / "ckpt")]) == 1
    assert cli.main(["verify", str(tmp_path / "ckpt"), "--quick"]) == 1


class _Spying(LocalStorage):
    """Local storage whose sequential streams log each copy into the caller's buffer in ``events``."""

    def __init__(self, root: str, events: list) -> None:
        super().__init__(root)
        self.events = events

    @contextlib.contextmanager
    def open_sequential(self, path: str, direct: bool = False):
        with super().open_sequential(path, direct) as f:
            events = self.events

            class Spy(io.RawIOBase):
                def readinto(self, b):
                    n = f.readinto(b)
                    events.append(("copy", n))
                    return n

            yield Spy()


def test_verified_sequential_reads_hash_each_piece_right_after_copying_it(tmp_path, monkeypatch):
    """A verified read into live memory (memory-tier restores) copies at most 1 MiB at a time and
    hashes each piece before the next copy, while it is still in the CPU cache (one pass over memory, not a
    copy and then a second hashing pass); a flipped byte is still found."""
    payload = bytearray(os.urandom((7 << 19) + 5))  # 3.5 MiB + 5: three whole pieces and two short ones
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "f.bin").write_bytes(payload)
    record = integrity.FileRecord(*integrity.hash_bytes(bytes(payload)), 0)
    events: list = []

    class SpyHasher:
        def __init__(self) -> None:
            self.inner = hashing.Hasher()

        def update(self, data) -> None:
            events.append(("hash", memoryview(data).nbytes))
            self.inner.update(data)

        def hexdigest(self) -> str:
            return self.inner.hexdigest()

    monkeypatch.setattr(integrity, "new_hasher", SpyHasher)
    storage = integrity.VerifyingStorage(_Spying(str(tmp_path), events), "t", {"f.bin": record})
    target = bytearray(len(payload))
    with storage.open_sequential("t/f.bin") as f:
        assert f.readinto(memoryview(target)) == len(payload)
    assert target == payload
    piece = 1 << 20
    expected = [e for n in (piece, piece, piece, (1 << 19) + 5) for e in (("copy", n), ("hash", n))]
    assert events[: len(expected)] == expected, events

    payload[(5 << 19) + 1] ^= 0x01  # one bit, in the fourth piece
    (tmp_path / "t" / "f.bin").write_bytes(payload)
    with pytest.raises(IntegrityError, match="f.bin"), storage.open_sequential("t/f.bin") as f:
        f.readinto(memoryview(target))
