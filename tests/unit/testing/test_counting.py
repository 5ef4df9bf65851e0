"""The scale benchmark's instruments count what they claim: S3 requests per storage call, store operations per
client (each forwarded to the real store)."""

from __future__ import annotations

from nxd_ckpt.ranks import coordinator
from nxd_ckpt.storage import LocalStorage
from nxd_ckpt.testing.counting import CountingStore, RequestCountingStorage


def test_request_counting_storage_counts_as_s3_would(tmp_path):
    s = RequestCountingStorage(LocalStorage(str(tmp_path)), part_size=1024)
    s.write_bytes("t/model/a.pt", b"x" * 10)  # one PUT
    with s.open_write("t/optim/b.pt") as f:  # 2,500 bytes: multipart (create, 3 parts, complete)
        f.write(b"y" * 2500)
    assert s.read_bytes("t/model/a.pt") == b"x" * 10
    assert s.exists("t/model/a.pt") and s.list_dir("t") == ["model", "optim"]
    s.delete_tree("t/optim")
    assert s.requests == {"PUT": 4, "POST": 3, "GET": 1, "HEAD": 1, "LIST": 2}
    assert s.by_prefix["t/model"] == {"PUT": 1, "GET": 1, "HEAD": 1}
    assert (s.files_written, s.bytes_written) == (2, 2510)
    assert not (tmp_path / "t" / "optim").exists()  # forwarded to the real storage


def test_counting_store_counts_each_client_and_forwards():
    server = coordinator.local_store(10.0)
    store = CountingStore(server)
    store.set("k", b"1")
    assert store.add("n", 2) == 2 and store.check(["k"])
    waiter = store.clone()
    waiter.wait(["k"])
    assert server.get("k") == b"1"
    assert store.tally.snapshot() == {
        ("main", "set"): 1,
        ("main", "add"): 1,
        ("main", "check"): 1,
        ("waiting", "wait"): 1,
    }
