"""Power-loss simulation: a FUSE pass-through filesystem that journals what was made durable, and when.

SIGKILL keeps every write the kernel accepted; a power cut keeps only what was fsynced. ``PowerLossMount`` mounts
a FUSE layer (libfuse 3 through the ``mfusepy`` ctypes binding, served by a child process) over a backing
directory. Every operation passes through to the backing directory, and the server journals, in order:

- ``fsync``/``fdatasync`` of a file, with the file's bytes at that moment;
- ``fsync`` of a directory (``fsyncdir``), with the directory's entries at that moment (name -> inode);
- every create, mkdir, rename (``RENAME_EXCHANGE`` included), unlink, rmdir, write and truncate.

``CrashJournal`` rebuilds from the journal the state a power cut before any journaled event leaves behind, under
two models. *Strict* (``materialize``): each directory holds exactly the entries of its last ``fsyncdir``
(nothing if it was never synced) and each file exactly its bytes of its last ``fsync`` (empty if never synced),
the worst case POSIX allows; this state changes only at fsyncs, so those are its cut points. *Ordered*
(``materialize_ordered``): namespace operations survive in the order they happened (a metadata-journaling
filesystem) but file data only as last fsynced, so a file renamed into place before its fsync comes back empty;
its cut points are every fsync and every namespace operation.

Inodes are identified by the server, not by the backing filesystem's inode numbers, which are reused after an
unlink. A test marks moments in the journal (``mark(label)``, e.g. "save of step_2 returned") by looking up
``/.powerloss-mark-<label>`` on the mount, which the server journals and answers with ENOENT.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import errno
import os
import pickle
import shutil
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from nxd_ckpt.storage.local import RENAME_EXCHANGE, rename_exchange

MARK_PREFIX = ".powerloss-mark-"
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The directory holding ``harness/``: on the file server's path, which runs ``-m harness.powerloss``."""


def fuse_unavailable_reason() -> str | None:
    """Why FUSE tests cannot run here (None when they can)."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing (no FUSE in this kernel/container): the power-loss suite needs it"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is not installed (apt-get install fuse3); scripts/setup_env.sh installs it as root"
    if _libfuse3() is None:
        return "libfuse 3 is not installed (apt-get install fuse3 libfuse3-3); scripts/setup_env.sh installs it as root"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as e:
        return f"the mfusepy FUSE binding or libfuse3 cannot be loaded ({e}); install nxd-ckpt[test] and libfuse3"
    return None


def _libfuse3() -> str | None:
    """libfuse 3's library name (mfusepy would prefer libfuse 2 where both are installed; rename2 flags need 3)."""
    return os.environ.get("FUSE_LIBRARY_PATH") or ctypes.util.find_library("fuse3")


# --------------------------------------------------------------------------------------------- server side


def _serve(backing: str, mountpoint: str, journal_path: str) -> None:
    """Child process: serve the pass-through filesystem until unmounted."""
    import mfusepy
    from mfusepy import FUSE, FuseOSError, Operations

    class Recorder(Operations):
        use_ns = True

        def __init__(self) -> None:
            self.root = os.path.realpath(backing)
            self._mutex = threading.RLock()
            self.journal = open(journal_path, "ab")  # noqa: SIM115 - lives as long as the server
            self.uids: dict[int, int] = {}
            self.next_uid = 1
            self._snapshot_initial_state()

        # -- journal
        def _log(self, *event: Any) -> None:
            pickle.dump(event, self.journal)
            self.journal.flush()

        def _uid(self, st_ino: int, fresh: bool = False) -> int:
            if fresh or st_ino not in self.uids:
                self.uids[st_ino] = self.next_uid
                self.next_uid += 1
            return self.uids[st_ino]

        def _entries(self, full: str) -> dict[str, tuple[int, bool]]:
            out = {}
            for name in os.listdir(full):
                st = os.lstat(os.path.join(full, name))
                out[name] = (self._uid(st.st_ino), stat.S_ISDIR(st.st_mode))
            return out

        def _snapshot_initial_state(self) -> None:
            """Whatever the backing directory holds at mount time counts as durable."""
            self._log("root", self._uid(os.lstat(self.root).st_ino))
            for dirpath, _dirs, files in os.walk(self.root):
                self._log("dir", self._uid(os.lstat(dirpath).st_ino), self._entries(dirpath), "<mount>")
                for name in files:
                    full = os.path.join(dirpath, name)
                    with open(full, "rb") as f:
                        self._log("file", self._uid(os.fstat(f.fileno()).st_ino), f.read(), "<mount>")

        def _full(self, path: str) -> str:
            return os.path.join(self.root, path.lstrip("/"))

        # -- metadata
        def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
            if path.startswith(f"/{MARK_PREFIX}"):
                with self._mutex:
                    self._log("mark", path[len(MARK_PREFIX) + 1 :])
                raise FuseOSError(errno.ENOENT)
            try:
                st = os.fstat(fh) if fh is not None else os.lstat(self._full(path))
            except OSError as e:
                raise FuseOSError(e.errno) from None
            keys = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_atime", "st_mtime", "st_ctime")
            out = {k: getattr(st, k) for k in keys}
            for k in ("st_atime", "st_mtime", "st_ctime"):
                out[k] = getattr(st, k + "_ns")
            return out

        def access(self, path: str, amode: int) -> int:
            if not os.access(self._full(path), amode):
                raise FuseOSError(errno.EACCES)
            return 0

        def readdir(self, path: str, fh: int) -> list[str]:
            return [".", "..", *os.listdir(self._full(path))]

        def statfs(self, path: str) -> dict[str, int]:
            st = os.statvfs(self._full(path))
            keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_flag")
            return {k: getattr(st, k) for k in (*keys, "f_frsize", "f_namemax")}

        def chmod(self, path: str, mode: int) -> int:
            os.chmod(self._full(path), mode)
            return 0

        def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
            os.utime(self._full(path), ns=times)
            return 0

        # -- namespace changes (journaled; durable only once the parent directory is fsynced)
        def mkdir(self, path: str, mode: int) -> int:
            with self._mutex:
                full = self._full(path)
                os.mkdir(full, mode)
                self._log("op", "mkdir", path, self._uid(os.lstat(full).st_ino, fresh=True))
            return 0

        def rmdir(self, path: str) -> int:
            with self._mutex:
                os.rmdir(self._full(path))
                self._log("op", "rmdir", path)
            return 0

        def unlink(self, path: str) -> int:
            with self._mutex:
                os.unlink(self._full(path))
                self._log("op", "unlink", path)
            return 0

        def rename(self, old: str, new: str) -> int:
            with self._mutex:
                os.rename(self._full(old), self._full(new))
                self._log("op", "rename", old, new)
            return 0

        def rename_flags(self, old: str, new: str, flags: int) -> int:
            """rename2 with flags: RENAME_EXCHANGE is passed through (journaled as one operation)."""
            if flags == 0:
                return self.rename(old, new)
            if flags != RENAME_EXCHANGE:
                raise FuseOSError(errno.EINVAL)
            with self._mutex:
                try:
                    rename_exchange(self._full(old), self._full(new))
                except OSError as e:
                    raise FuseOSError(e.errno) from None
                self._log("op", "exchange", old, new)
            return 0

        # -- files
        def create(self, path: str, mode: int, fi: Any = None) -> int:
            with self._mutex:
                fd = os.open(self._full(path), os.O_RDWR | os.O_CREAT | os.O_TRUNC, mode)
                self._log("op", "create", path, self._uid(os.fstat(fd).st_ino, fresh=True))
            return fd

        def open(self, path: str, flags: int) -> int:
            flags &= ~(os.O_DIRECT | os.O_CREAT | os.O_EXCL)
            with self._mutex:
                fd = os.open(self._full(path), flags)
                if flags & os.O_TRUNC:
                    self._log("op", "truncate", path)
            return fd

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            return os.pread(fh, size, offset)

        def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
            with self._mutex:
                n = os.pwrite(fh, data, offset)
                self._log("op", "write", path, offset, n)
            return n

        def truncate(self, path: str, length: int, fh: int | None = None) -> int:
            with self._mutex:
                if fh is not None:
                    os.ftruncate(fh, length)
                else:
                    os.truncate(self._full(path), length)
                self._log("op", "truncate", path, length)
            return 0

        def flush(self, path: str, fh: int) -> int:
            return 0

        def release(self, path: str, fh: int) -> int:
            os.close(fh)
            return 0

        def fsync(self, path: str, datasync: int, fh: int) -> int:
            with self._mutex:
                st = os.fstat(fh)
                data = os.pread(fh, st.st_size, 0) if st.st_size else b""
                self._log("file", self._uid(st.st_ino), data, path)
            return 0

        # -- directories
        def opendir(self, path: str) -> int:
            return 0

        def releasedir(self, path: str, fh: int) -> int:
            return 0

        def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
            with self._mutex:
                full = self._full(path)
                self._log("dir", self._uid(os.lstat(full).st_ino), self._entries(full), path)
            return 0

    class FlagPassingFUSE(FUSE):
        """mfusepy drops rename2's flags (a RENAME_EXCHANGE would silently become a plain rename): pass them."""

        def rename_fuse_3(self, old: bytes, new: bytes, flags: int) -> int:
            return self.operations.rename_flags(old.decode(), new.decode(), flags)

    del mfusepy
    FlagPassingFUSE(Recorder(), mountpoint, foreground=True, nothreads=False, fsname="nxd_powerloss")


# --------------------------------------------------------------------------------------------- test side


Tree = dict[int, dict[str, tuple[int, bool]]]
"""Directories by inode: name -> (inode, is_dir)."""


@dataclass
class CrashJournal:
    """Everything one mount journaled, in order, and the post-crash states it allows under two models.

    ``strict`` (``materialize``): only what was fsynced survives, file data and directory entries alike (the
    worst case POSIX allows). ``ordered`` (``materialize_ordered``): namespace operations (create, mkdir,
    rename, unlink, rmdir) survive in the order they happened, as on a filesystem that journals metadata, but file
    data survives only if fsynced (a renamed-in file that was not synced comes back empty).
    """

    root: int
    sequence: list[tuple] = field(default_factory=list)
    """Every journaled event after the mount-time snapshot, in order."""
    initial: list[tuple] = field(default_factory=list)
    """The mount-time snapshot: ("dir"/"file", uid, payload, "<mount>") events."""

    @classmethod
    def read(cls, path: str) -> CrashJournal:
        journal: CrashJournal | None = None
        with open(path, "rb") as f:
            while True:
                try:
                    event = pickle.load(f)
                except EOFError:
                    break
                if event[0] == "root":
                    journal = cls(root=event[1])
                elif journal is None:
                    raise RuntimeError(f"power-loss journal {path} does not start with the root")
                elif event[0] in ("file", "dir") and event[-1] == "<mount>":
                    journal.initial.append(event)
                else:
                    journal.sequence.append(event)
        if journal is None:
            raise RuntimeError(f"power-loss journal {path} is empty: the FUSE server never started")
        return journal

    @property
    def durability_events(self) -> list[int]:
        """Positions in ``sequence`` of the fsyncs (files and directories)."""
        return [i for i, e in enumerate(self.sequence) if e[0] in ("file", "dir")]

    def cut_points(self) -> list[int]:
        """Strict model: cut positions in ``sequence`` that can give distinct states (before each fsync, and
        at the end): under this model nothing else changes what survives."""
        return [*self.durability_events, len(self.sequence)]

    def ordered_cut_points(self) -> list[int]:
        """Ordered model: before every fsync and every namespace operation, and at the end."""
        changes = ("file", "dir")
        names = ("create", "mkdir", "rename", "exchange", "unlink", "rmdir")
        return [i for i, e in enumerate(self.sequence) if e[0] in changes or (e[0] == "op" and e[1] in names)] + [
            len(self.sequence)
        ]

    def marks_before(self, cut: int) -> list[str]:
        return [e[1] for e in self.sequence[:cut] if e[0] == "mark"]

    def describe(self, cut: int) -> str:
        """The event a cut comes just before (for failure messages)."""
        if cut >= len(self.sequence):
            return "after the last event"
        event = self.sequence[cut]
        if event[0] in ("file", "dir"):
            return f"before fsync{'dir' if event[0] == 'dir' else ''} of {event[3]} (event {cut})"
        return f"before {' '.join(map(str, event[1:]))} (event {cut})"

    def _durable(self, cut: int) -> tuple[dict[int, bytes], Tree]:
        files: dict[int, bytes] = {}
        dirs: Tree = {}
        for kind, uid, payload, _path in [*self.initial, *(e for e in self.sequence[:cut] if e[0] in ("file", "dir"))]:
            if kind == "file":
                files[uid] = payload
            else:
                dirs[uid] = dict(payload)
        return files, dirs

    def materialize(self, cut: int, dest: str) -> None:
        """Strict model: write to ``dest`` what survives a power cut before ``sequence[cut]``."""
        files, dirs = self._durable(cut)
        self._build(dirs, files, dest)

    def materialize_ordered(self, cut: int, dest: str) -> None:
        """Ordered model: the namespace as it was before ``sequence[cut]``, file data as last fsynced."""
        files, _ = self._durable(cut)
        _, tree = self._durable(0)  # the mount-time namespace, then every namespace operation replayed
        for event in self.sequence[:cut]:
            if event[0] != "op":
                continue
            op = event[1]
            if op in ("create", "mkdir"):
                parent, name = self._parent(tree, event[2])
                tree[parent][name] = (event[3], op == "mkdir")
                if op == "mkdir":
                    tree[event[3]] = {}
            elif op in ("unlink", "rmdir"):
                parent, name = self._parent(tree, event[2])
                tree[parent].pop(name, None)
            elif op == "exchange":
                a_parent, a_name = self._parent(tree, event[2])
                b_parent, b_name = self._parent(tree, event[3])
                tree[a_parent][a_name], tree[b_parent][b_name] = tree[b_parent][b_name], tree[a_parent][a_name]
            elif op == "rename":
                old_parent, old_name = self._parent(tree, event[2])
                new_parent, new_name = self._parent(tree, event[3])
                tree[new_parent][new_name] = tree[old_parent].pop(old_name)
        self._build(tree, files, dest)

    def _parent(self, tree: Tree, path: str) -> tuple[int, str]:
        parts = [p for p in path.split("/") if p]
        uid = self.root
        for part in parts[:-1]:
            uid = tree[uid][part][0]
        return uid, parts[-1]

    def _build(self, dirs: Tree, files: dict[int, bytes], dest: str) -> None:
        os.makedirs(dest, exist_ok=True)

        def build(uid: int, where: str, depth: int) -> None:
            if depth > 64:
                raise RuntimeError("directory cycle in the power-loss journal")
            for name, (child, is_dir) in dirs.get(uid, {}).items():
                target = os.path.join(where, name)
                if is_dir:
                    os.mkdir(target)
                    build(child, target, depth + 1)
                else:
                    with open(target, "wb") as f:
                        f.write(files.get(child, b""))

        build(self.root, dest, 0)


def _with_root() -> dict[str, str]:
    """``PYTHONPATH`` with the repository root first: the harness is not installed, only found from there."""
    return {"PYTHONPATH": os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)}


class PowerLossMount:
    """Context manager: a recording FUSE mount of ``backing`` at ``mountpoint`` (both created)."""

    def __init__(self, backing: str, mountpoint: str, journal_path: str, startup_timeout: float = 30.0) -> None:
        self.backing = os.fspath(backing)
        self.mountpoint = os.fspath(mountpoint)
        self.journal_path = os.fspath(journal_path)
        self.startup_timeout = startup_timeout
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> PowerLossMount:
        reason = fuse_unavailable_reason()
        if reason is not None:
            raise RuntimeError(reason)
        os.makedirs(self.backing, exist_ok=True)
        os.makedirs(self.mountpoint, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.journal_path)
        self._log = open(self.journal_path + ".server.log", "wb")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "harness.powerloss", self.backing, self.mountpoint, self.journal_path],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONWARNINGS": "ignore", "FUSE_LIBRARY_PATH": _libfuse3() or "", **_with_root()},
        )
        deadline = time.monotonic() + self.startup_timeout
        while not os.path.ismount(self.mountpoint):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self._stop()
                raise RuntimeError(f"the power-loss FUSE server did not mount {self.mountpoint}: {self._server_log()}")
            time.sleep(0.02)
        return self

    def mark(self, label: str) -> None:
        """Journal a moment (between durability events), e.g. 'saved step_2'."""
        os.path.exists(os.path.join(self.mountpoint, MARK_PREFIX + label))

    def journal(self) -> CrashJournal:
        return CrashJournal.read(self.journal_path)

    def _server_log(self) -> str:
        with contextlib.suppress(OSError), open(self.journal_path + ".server.log", "rb") as f:
            return f.read()[-4000:].decode(errors="replace")
        return ""

    def _stop(self) -> None:
        if self._proc is None:
            return
        if os.path.ismount(self.mountpoint):
            subprocess.run(["fusermount3", "-u", self.mountpoint], check=False, capture_output=True, timeout=30)
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=30)
            subprocess.run(["fusermount3", "-uz", self.mountpoint], check=False, capture_output=True, timeout=30)
        self._proc = None
        self._log.close()

    def __exit__(self, *exc: Any) -> None:
        self._stop()


@contextlib.contextmanager
def mounted(base: str) -> Iterator[PowerLossMount]:
    """A recording mount under ``base`` (backing/, mnt/, journal.pkl)."""
    with PowerLossMount(
        os.path.join(base, "backing"), os.path.join(base, "mnt"), os.path.join(base, "journal.pkl")
    ) as m:
        yield m


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2], sys.argv[3])
