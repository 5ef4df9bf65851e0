"""Storage capabilities are explicit and every wrapper forwards all of them (no ``__getattr__``)."""

from __future__ import annotations

import inspect
import os

import pytest

from nxd_ckpt.cli.progress import ReadProgressStorage
from nxd_ckpt.format import integrity, layout, manifests
from nxd_ckpt.storage import DelegatingStorage, LocalStorage, Storage
from nxd_ckpt.storage.local import atomic_file

PUBLIC = sorted(n for n in dir(Storage) if not n.startswith("_") and n != "url")
WRAPPERS = [DelegatingStorage, integrity.ChecksummingStorage, integrity.VerifyingStorage, ReadProgressStorage]


def test_delegating_storage_forwards_every_method_and_capability_by_name():
    """A method added to Storage must be forwarded (or consciously overridden) by DelegatingStorage: else a
    wrapper would run the base implementation and silently bypass the backend's own."""
    missing = [n for n in PUBLIC if n not in DelegatingStorage.__dict__]
    assert not missing, f"DelegatingStorage does not forward {missing}"


@pytest.mark.parametrize("cls", WRAPPERS, ids=lambda c: c.__name__)
def test_no_wrapper_forwards_by_getattr(cls):
    assert all("__getattr__" not in vars(k) for k in cls.__mro__ if issubclass(k, Storage))


class _Spy(Storage):
    """Records which method was called; every method answers something valid."""

    url = "spy://"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def _hit(self, name: str, value: object = None) -> object:
        self.calls.append(name)
        return value

    def open_write(self, path):  # type: ignore[no-untyped-def]
        return self._hit("open_write", _null())

    def open_read(self, path):  # type: ignore[no-untyped-def]
        return self._hit("open_read", _null())

    def read_bytes(self, path, offset=0, length=None):  # type: ignore[no-untyped-def]
        return self._hit("read_bytes", b"")

    def read_buffer(self, path, allocate=None):  # type: ignore[no-untyped-def]
        return self._hit("read_buffer")

    def exists(self, path):  # type: ignore[no-untyped-def]
        return self._hit("exists", True)

    def list_dir(self, path=""):  # type: ignore[no-untyped-def]
        return self._hit("list_dir", [])

    def size(self, path):  # type: ignore[no-untyped-def]
        return self._hit("size", 0)

    def mtime(self, path):  # type: ignore[no-untyped-def]
        return self._hit("mtime", 0.0)

    def delete(self, path):  # type: ignore[no-untyped-def]
        return self._hit("delete")

    def delete_tree(self, path):  # type: ignore[no-untyped-def]
        return self._hit("delete_tree")

    def sync_dirs(self, paths):  # type: ignore[no-untyped-def]
        return self._hit("sync_dirs")

    def write_bytes(self, path, data):  # type: ignore[no-untyped-def]
        return self._hit("write_bytes")

    def walk_files(self, path=""):  # type: ignore[no-untyped-def]
        return self._hit("walk_files", [])

    def durability_batch(self):  # type: ignore[no-untyped-def]
        return self._hit("durability_batch", _null())

    def local_path(self, path):  # type: ignore[no-untyped-def]
        return self._hit("local_path", "/x")

    def write_from_local_file(self, path, local_file):  # type: ignore[no-untyped-def]
        return self._hit("write_from_local_file")

    def open_sequential(self, path, direct=False):  # type: ignore[no-untyped-def]
        return self._hit("open_sequential", _null())

    def rename_dir(self, src, dst):  # type: ignore[no-untyped-def]
        return self._hit("rename_dir")

    def exchange_dirs(self, a, b):  # type: ignore[no-untyped-def]
        return self._hit("exchange_dirs", True)

    @property
    def renames_dirs(self):  # type: ignore[no-untyped-def, override]
        return self._hit("renames_dirs", True)

    @property
    def host_page_cache(self):  # type: ignore[no-untyped-def, override]
        return self._hit("host_page_cache", True)

    @property
    def ranged_reads(self):  # type: ignore[no-untyped-def, override]
        return self._hit("ranged_reads", True)

    @property
    def whole_file_reads(self):  # type: ignore[no-untyped-def, override]
        return self._hit("whole_file_reads", True)

    @property
    def mtime_resolution_s(self):  # type: ignore[no-untyped-def, override]
        return self._hit("mtime_resolution_s", 1.0)


class _null:
    def __enter__(self):  # type: ignore[no-untyped-def]
        return self

    def __exit__(self, *exc):  # type: ignore[no-untyped-def]
        return False


def _call(storage: Storage, name: str) -> None:
    attr = inspect.getattr_static(type(storage), name)
    if isinstance(attr, property) or not callable(attr):
        getattr(storage, name)
        return
    params = [p for p in inspect.signature(attr).parameters.values() if p.name != "self" and p.default is p.empty]
    args = {
        "path": "f",
        "paths": ["d"],
        "data": b"",
        "local_file": __file__,
        "src": "a",
        "dst": "b",
        "a": "a",
        "b": "b",
    }
    getattr(storage, name)(*[args[p.name] for p in params])


def test_spy_covers_the_whole_interface():
    assert [n for n in PUBLIC if n not in _Spy.__dict__] == []


@pytest.mark.parametrize("name", PUBLIC)
def test_every_call_reaches_the_backend(name):
    spy = _Spy()
    _call(DelegatingStorage(spy), name)
    assert spy.calls == [name]


def test_checksumming_storage_records_files_written_from_local_files(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(b"x" * 1000)
    store = integrity.ChecksummingStorage(LocalStorage(tmp_path / "ckpt"), "t1", rank=0)
    store.write_from_local_file("t1/model/a.pt", str(src))
    with open(src, "rb") as f:
        expected = manifests.record_stream(f, 0)
    assert store.records == {"model/a.pt": expected} and expected.blocks == ((1000, expected.digest),)
    assert (tmp_path / "ckpt" / "t1" / "model" / "a.pt").read_bytes() == src.read_bytes()


def test_capabilities_of_the_backends_and_wrappers(tmp_path):
    local = LocalStorage(tmp_path)
    assert local.local_path("a/b.pt") == os.path.join(str(tmp_path), "a", "b.pt")
    assert not local.ranged_reads and local.host_page_cache
    # a verifying wrapper hides the local path of files it must check (a direct read would skip the check)
    index = {"model/a.pt": manifests.FileRecord(1, "00", 0)}
    verifying = integrity.VerifyingStorage(local, "t1", index)
    assert verifying.local_path("t1/model/a.pt") is None
    assert verifying.local_path("t1/model/b.pt") == local.local_path("t1/model/b.pt")
    assert ReadProgressStorage(local, lambda n: None).local_path("t1/x") is None  # every byte must be counted
    with local.durability_batch():  # batches fsyncs on local disk
        local.write_bytes(layout.tag_path("t1", "x"), b"1")


def test_atomic_file_never_leaves_half_a_file(tmp_path):
    final = tmp_path / "d" / "out.bin"
    with pytest.raises(RuntimeError), atomic_file(str(final)) as tmp:
        with open(tmp, "wb") as f:
            f.write(b"half")
        raise RuntimeError("crash")
    assert not final.exists() and os.listdir(tmp_path / "d") == []
    with atomic_file(str(final)) as tmp, open(tmp, "wb") as f:
        f.write(b"whole")
    assert final.read_bytes() == b"whole" and os.listdir(tmp_path / "d") == ["out.bin"]
