"""The memory tier's parts without processes: configuration errors, node numbering, choosing a tag from what
nodes report, the budget check, eviction, and the file transport between nodes (a real server on localhost)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import nxd_ckpt as nxd
from nxd_ckpt.errors import CheckpointError, MemoryTierFullError
from nxd_ckpt.format import layout
from nxd_ckpt.manager import CheckpointManager
from nxd_ckpt.testing.fakes import assert_state_equal
from nxd_ckpt.tier.memory import (
    Marker,
    MemoryTier,
    Report,
    check_budget,
    choose_memory_tag,
    evict,
    list_markers,
    nodes_of,
)
from nxd_ckpt.tier.transport import FileClient, FileServer, MissingOnPeer, PeerError

pytestmark = pytest.mark.device_independent  # the tier's host-side parts: runs once, in the CPU lane


def test_config_errors_say_what_to_use():
    with pytest.raises(ValueError, match="use max_copies >= 4"):
        MemoryTier(max_copies=3, replicas=1)
    with pytest.raises(ValueError, match="durable_every must be an integer >= 1"):
        MemoryTier(durable_every=0)
    assert MemoryTier(max_copies=6, replicas=2).tags_kept == 2
    assert MemoryTier(dir="/x/node{node}").node_dir(3) == "/x/node3"


def test_nodes_and_ring_peers():
    nodes = nodes_of(8, 2, ["h"] * 8, replicas=1)
    assert nodes.count == 4 and nodes.node_of(5) == 2
    assert nodes.peer_ranks(5, 1) == [7] and nodes.peer_ranks(7, 1) == [1]
    assert nodes_of(8, 2, ["h"] * 8, replicas=2).peer_ranks(0, 2) == [2, 4]
    with pytest.raises(CheckpointError, match="needs more than 1 node"):
        nodes_of(4, 4, ["h"] * 4, replicas=1)
    with pytest.raises(CheckpointError, match="whole nodes"):
        nodes_of(6, 4, ["h"] * 6, replicas=1)
    with pytest.raises(CheckpointError, match="numbered node by node"):
        nodes_of(4, 2, ["a", "b", "a", "b"], replicas=1)


def _report(rank: int, node: int, *markers: Marker) -> Report:
    return Report(rank, node, f"h:{rank}", markers)


def test_choose_the_newest_tag_every_rank_part_is_held_for():
    m = lambda share, tag, rank, t: Marker(share, tag, rank, t, 4)  # noqa: E731
    node0 = [m(0, "s1", 0, 1.0), m(0, "s1", 1, 1.0), m(0, "s2", 0, 2.0), m(0, "s2", 1, 2.0)]
    node1 = [m(1, "s1", 2, 1.0), m(1, "s1", 3, 1.0), m(1, "s2", 2, 2.0)]  # rank 3's part of s2 never finished
    replicas_on_1 = [m(0, "s1", 0, 1.0), m(0, "s1", 1, 1.0)]
    reports = [_report(0, 0, *node0), _report(2, 1, *node1, *replicas_on_1)]
    choice = choose_memory_tag(reports)
    assert choice is not None and choice.tag == "s1"
    assert choice.holders == {0: (0, 1), 1: (0, 1), 2: (1,), 3: (1,)} and choice.shares[2] == 1
    assert choose_memory_tag(reports, tag="s2") is None
    assert choose_memory_tag([_report(0, 0, *node0)]) is None


def _write_marker(root: str, share: int, tag: str, rank: int, t: float) -> None:
    path = os.path.join(root, layout.memory_share_dir(share), layout.tier_marker_file(tag, rank))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(Marker(share, tag, rank, t, 2).to_bytes())


def test_eviction_keeps_the_newest_and_the_one_being_written(tmp_path):
    root = str(tmp_path)
    for i, tag in enumerate(["a", "b", "c"]):
        _write_marker(root, 0, tag, 0, float(i))
        _write_marker(root, 1, tag, 1, float(i))
    assert evict(root, keep=2, protect="d") == ["a", "b"]
    assert sorted(m.tag for m in list_markers(root)) == ["c", "c"]
    assert evict(root, keep=2, protect="c") == []
    # a newer tag this node's own share holds only in part (a failed save) goes before the complete one
    _write_marker(root, 0, "c", 2, 2.0)
    _write_marker(root, 0, "e", 0, 9.0)
    assert evict(root, keep=2, protect="f", own_share=0, own_ranks=[0, 2]) == ["e"]
    assert evict(root, keep=2, protect="f", own_share=0, own_ranks=[0, 2]) == []


def test_budget_error_before_staging(tmp_path):
    with pytest.raises(MemoryTierFullError, match="cannot hold checkpoint 'step_9'.*MemoryTier.max_copies"):
        check_budget(str(tmp_path), MemoryTier(), "step_9", need_bytes=1 << 62)
    check_budget(str(tmp_path), MemoryTier(), "step_9", need_bytes=1)


def test_transport_copies_fetches_and_refuses_strangers(tmp_path):
    src = tmp_path / "file.bin"
    payload = os.urandom(3 << 20)
    src.write_bytes(payload)
    server = FileServer(str(tmp_path / "peer"), token="secret", timeout_s=10, bind="127.0.0.1")
    address = f"127.0.0.1:{server.port}"
    try:
        client = FileClient("secret", timeout_s=10)
        client.put_file(address, "node_00000/t/model/x.pt", str(src))
        assert (tmp_path / "peer" / "node_00000" / "t" / "model" / "x.pt").read_bytes() == payload
        pieces: list[int] = []
        got = client.get(address, "node_00000/t/model/x.pt", on_piece=lambda v: pieces.append(len(v)))
        assert got.tobytes() == payload and sum(pieces) == len(payload)
        assert isinstance(got, np.ndarray)
        with pytest.raises(MissingOnPeer, match="not held here"):
            client.get(address, "node_00000/t/model/missing.pt")
        with pytest.raises(PeerError, match="wrong token"):
            FileClient("guess", timeout_s=10).get(address, "node_00000/t/model/x.pt")
        with pytest.raises(PeerError, match="'..' component"):
            client.put_file(address, "../escape.bin", str(src))
        assert not (tmp_path / "escape.bin").exists()
        client.delete(address, "node_00000/t/model/x.pt")
        assert not (tmp_path / "peer" / "node_00000" / "t" / "model" / "x.pt").exists()
    finally:
        server.close()
    with pytest.raises(PeerError, match="cannot reach"):
        FileClient("secret", timeout_s=2).get(address, "node_00000/t/model/x.pt")


# ------------------------------------------------------------------------------------ one process, one node
def _one_node(tmp_path) -> MemoryTier:
    return MemoryTier(dir=str(tmp_path / "mem"), replicas=0, durable_every=2, max_copies=2)


def _model(value: float) -> dict:
    return {"w": torch.full((64,), value), "b": torch.arange(8, dtype=torch.float64) * value}


def test_sync_saves_named_tags_and_eviction_in_one_process(tmp_path):
    ckpt, tier = str(tmp_path / "ckpt"), _one_node(tmp_path)
    manager = CheckpointManager(memory_tier=tier)
    for step in range(1, 5):
        manager.save(ckpt, f"s{step}", model=_model(step))
    assert nxd.list_checkpoint_tags(ckpt) == ["s2", "s4"]
    (root,) = (tmp_path / "mem").glob("ckpt-*")
    assert sorted(os.listdir(root / "node_00000")) == ["s3", "s4"]  # budget: two tags
    target = _model(0)
    manager.load(ckpt, model=target)
    assert manager.last_restore.tag == "s4" and manager.last_restore.tiers == ["memory"]
    assert_state_equal(target, _model(4))
    manager.load(ckpt, "s3", model=target)  # named, held in memory only
    assert_state_equal(target, _model(3))
    assert manager.last_restore.tier == "memory"
    manager.load(ckpt, "s2", model=target)  # named, evicted from memory: durable
    assert_state_equal(target, _model(2))
    assert manager.last_restore.tiers == ["durable"]
    manager.save(ckpt, "s4", model=_model(40))  # saving a tag again replaces its memory copy
    manager.load(ckpt, model=target)
    assert_state_equal(target, _model(40))
    assert manager.last_restore.tier == "memory"
    manager.finalize()


def test_damaged_memory_copy_without_peers_falls_back_to_durable(tmp_path):
    ckpt, tier = str(tmp_path / "ckpt"), _one_node(tmp_path)
    manager = CheckpointManager(memory_tier=tier)
    manager.save(ckpt, "s1", model=_model(1), async_save=True)
    manager.save(ckpt, "s2", model=_model(2), async_save=True)
    manager.finalize()
    (root,) = (tmp_path / "mem").glob("ckpt-*")
    model_file = root / "node_00000" / layout.model_file("s2", 0, 0)
    model_file.write_bytes(model_file.read_bytes()[:-3])
    target = _model(0)
    manager.load(ckpt, model=target)
    assert manager.last_restore.tag == "s2" and manager.last_restore.tiers == ["durable"]
    assert_state_equal(target, _model(2))
    manager.finalize()


def test_one_node_with_replicas_is_refused_clearly(tmp_path):
    manager = CheckpointManager(memory_tier=MemoryTier(dir=str(tmp_path / "mem")))
    with pytest.raises(CheckpointError, match=r"replicas=1\) needs more than 1 node.*use replicas=0"):
        manager.save(str(tmp_path / "ckpt"), "s1", model=_model(1))
    with pytest.raises(TypeError, match="memory_tier must be a nxd_ckpt.MemoryTier"):
        manager.save(str(tmp_path / "ckpt"), "s1", model=_model(1), memory_tier="/dev/shm")
    manager.finalize()


def test_transport_streams_a_file_into_the_callers_buffers(tmp_path):
    payload = os.urandom((1 << 20) + 17)
    (tmp_path / "peer" / "node_00001").mkdir(parents=True)
    (tmp_path / "peer" / "node_00001" / "f.bin").write_bytes(payload)
    server = FileServer(str(tmp_path / "peer"), token="t", timeout_s=10, bind="127.0.0.1")
    try:
        client = FileClient("t", timeout_s=10)
        with client.open_stream(f"127.0.0.1:{server.port}", "node_00001/f.bin") as stream:
            target = bytearray(len(payload) + 5)
            view, done = memoryview(target), 0
            while n := stream.readinto(view[done:]):
                done += n
        assert stream.size == len(payload) and bytes(target[:done]) == payload
    finally:
        server.close()


def test_the_durable_copy_of_a_tier_save_is_not_hashed_again_and_verifies(tmp_path, monkeypatch):
    """Each file of a save is hashed once, as it is written to node memory; the durable copy records
    the same checksums (a fresh hash of the copy would bless a copy damaged in between)."""
    from nxd_ckpt.format import integrity

    def no_second_hash(f):
        raise AssertionError("a tier save's durable copy hashed its files again")

    monkeypatch.setattr(integrity, "hash_stream", no_second_hash)
    ckpt = str(tmp_path / "ckpt")
    manager = CheckpointManager(memory_tier=MemoryTier(dir=str(tmp_path / "mem"), replicas=0, max_copies=2))
    manager.save(ckpt, "s1", model=_model(1), use_xser=True)
    manager.save(ckpt, "s2", model=_model(2))
    manager.finalize()
    for tag, step in (("s1", 1), ("s2", 2)):
        target = _model(0)
        nxd.load_checkpoint(ckpt, tag, model=target)  # durable, verified against the recorded checksums
        assert_state_equal(target, _model(step))


def test_transport_sends_a_file_by_sendfile_and_fills_whole_pieces(tmp_path, monkeypatch):
    """The server sends a file with ``sendfile`` (the kernel copies its pages into the socket; measured
    faster than one sendall from a populated mapping), and the receiver's buffers are filled whole (one system
    call per piece)."""
    from nxd_ckpt.tier import transport

    payload = os.urandom(12 << 20)  # three times the largest socket send buffer Linux grants by default
    (tmp_path / "peer" / "node_00001").mkdir(parents=True)
    (tmp_path / "peer" / "node_00001" / "f.bin").write_bytes(payload)
    sent: list[int] = []
    real_sendfile = os.sendfile

    def recording(out_fd: int, in_fd: int, offset: int, count: int) -> int:
        n = real_sendfile(out_fd, in_fd, offset, count)
        sent.append(n)
        return n

    monkeypatch.setattr(transport.os, "sendfile", recording)
    server = FileServer(str(tmp_path / "peer"), token="t", timeout_s=10, bind="127.0.0.1")
    try:
        client = FileClient("t", timeout_s=10)
        target, got = bytearray(len(payload)), []
        with client.open_stream(f"127.0.0.1:{server.port}", "node_00001/f.bin") as stream:
            view = memoryview(target)
            for start in range(0, len(payload), 1 << 20):
                got.append(stream.readinto(view[start : start + (1 << 20)]))
        assert bytes(target) == payload
        assert got == [1 << 20] * 12
        assert sum(sent) == len(payload) and all(n > 0 for n in sent)
    finally:
        server.close()


def test_transport_gives_up_on_a_peer_that_stops_sending(tmp_path):
    """A peer that stalls mid-file fails the fetch after the deadline (no receive waits forever)."""
    import json
    import socket
    import threading

    from nxd_ckpt.errors import CheckpointTimeoutError

    listener = socket.create_server(("127.0.0.1", 0))
    release = threading.Event()

    def stalling_peer() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(json.dumps({"ok": True, "size": 100}).encode() + b"\n" + b"x" * 10)
            release.wait(10)

    thread = threading.Thread(target=stalling_peer, daemon=True)
    thread.start()
    try:
        client = FileClient("t", timeout_s=0.5)
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        with (
            pytest.raises(CheckpointTimeoutError, match="sent nothing for 0.5 s"),
            client.open_stream(address, "node_00001/f.bin") as stream,
        ):
            buf = bytearray(100)
            while stream.readinto(memoryview(buf)):
                pass
    finally:
        release.set()
        thread.join(5)
        listener.close()


def test_a_stream_is_woken_per_mebibyte_and_still_reads_a_short_tail(tmp_path, monkeypatch):
    """A streamed fetch asks the kernel to wake it once WAKE_BYTES have arrived (SO_RCVLOWAT: fewer
    wake-ups, less CPU on both sides), and never for more than the rest of the caller's piece, so pieces and a
    file end shorter than that arrive without waiting for the deadline."""
    import socket as socket_module
    import time

    from nxd_ckpt.tier import transport

    payload = os.urandom(3 * transport.WAKE_BYTES + 4097)
    (tmp_path / "peer" / "node_00001").mkdir(parents=True)
    (tmp_path / "peer" / "node_00001" / "f.bin").write_bytes(payload)
    asked: list[int] = []
    real_wake_after = transport._Stream._wake_after

    def recording(self, nbytes: int) -> None:
        real_wake_after(self, nbytes)
        asked.append(self._sock.getsockopt(socket_module.SOL_SOCKET, socket_module.SO_RCVLOWAT))

    monkeypatch.setattr(transport._Stream, "_wake_after", recording)
    server = FileServer(str(tmp_path / "peer"), token="t", timeout_s=10, bind="127.0.0.1")
    try:
        client = FileClient("t", timeout_s=30)
        target = bytearray(len(payload))
        view, done = memoryview(target), 0
        start = time.monotonic()
        with client.open_stream(f"127.0.0.1:{server.port}", "node_00001/f.bin") as stream:
            for piece in (2 * transport.WAKE_BYTES, 100, transport.WAKE_BYTES):  # then the rest: 3997 bytes
                done += stream.readinto(view[done : done + piece])
            while n := stream.readinto(view[done:]):
                done += n
        assert bytes(target) == payload
        assert time.monotonic() - start < 10  # no piece waited for bytes that were never coming
        assert asked[0] == transport.WAKE_BYTES and asked[1] == 100 and asked[-1] == 3997
    finally:
        server.close()
