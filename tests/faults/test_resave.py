"""Re-saving a tag that holds a complete checkpoint keeps the old one loadable until the new one is complete.

The new checkpoint is written beside the old one (a hidden directory) and swapped in by rank 0's commit; a crash
in between is finished or undone by the next save or load (tags.recover_resaves). Proven here by a SIGKILL at
every filesystem mutation of a re-save (sync and async, plain and xser); the power-loss suite
(test_power_loss.py) cuts power at every fsync of 2-rank re-saves.
"""

from __future__ import annotations

import os
import shutil

import pytest

import nxd_ckpt as nxd
from harness.crashloop import model_state, optimizer_state, read_mutation_log, run_resave
from nxd_ckpt.format import layout
from nxd_ckpt.testing.fakes import assert_state_equal

pytestmark = pytest.mark.device_independent

TAG = "step_7"


def _load(ckpt: str, tag: str | None = None) -> int:
    """Load ``tag`` (default: latest) verified; check it bit-exactly against its version; return the version."""
    model: dict = {}
    optimizer: dict = {}
    content = nxd.load_checkpoint(ckpt, tag, model=model, optimizer=optimizer)
    version = content["version"]
    assert_state_equal(model, model_state(version))
    assert_state_equal(optimizer, optimizer_state(version))
    return version


def _hidden(ckpt: str) -> list[str]:
    """What a re-save left at the root (the index of ``latest`` belongs there; a kill while it was being written
    can leave its temporary file, which readers skip: see docs/scale.md)."""
    index = layout.TAG_INDEX_FILE
    ours = (index, f".{index}.tmp-")
    return sorted(n for n in os.listdir(ckpt) if n.startswith(".") and not n.startswith(ours))


def _made_new_complete(log: list[tuple[str, ...]]) -> bool:
    """Whether a re-save's logged mutations include the one that marks its new copy complete (its ``done`` put in
    place): from there on the tag must load as the new version, before it the old."""
    done = f"{layout.resave_dir(TAG)}/{layout.DONE_MARKER}"
    return any(m[0] in ("replace", "rename") and m[-1].endswith(done) for m in log)


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [{}, {"async_save": True, "use_xser": True}],
    ids=["sync-plain", "async-xser"],
)
def test_sigkill_at_every_mutation_of_a_resave(tmp_path, options):
    pristine = str(tmp_path / "pristine")
    assert run_resave(pristine, TAG, version=1, options=options) > 0
    full = str(tmp_path / "full")
    shutil.copytree(pristine, full)
    full_log = str(tmp_path / "full.log")
    mutations = run_resave(full, TAG, version=2, options=options, log_path=full_log)
    assert _load(full) == 2 and _hidden(full) == [] and mutations > 10
    assert _made_new_complete(read_mutation_log(full_log))
    swapped_at = None
    for kill_after in range(mutations):
        ckpt, log_path = str(tmp_path / f"k{kill_after}"), str(tmp_path / f"k{kill_after}.log")
        shutil.copytree(pristine, ckpt)
        outcome = run_resave(ckpt, TAG, version=2, kill_after=kill_after, options=options, log_path=log_path)
        # -1: killed at that mutation. An async save's mutation count can differ by a few between runs (which
        # thread reaches the filesystem first); a run that finished before the kill point must have made fewer.
        assert outcome == -1 or outcome <= kill_after, (kill_after, outcome)
        # The tag stays loadable after any kill: the old version until the new one was complete, then the new.
        # Which mutation completed the new copy is read from this run's log: an async save's threads need not
        # reach the filesystem in the same order each run, so an index names a different mutation in each.
        assert nxd.list_checkpoint_tags(ckpt) == [TAG] or _hidden(ckpt), kill_after
        version = _load(ckpt, TAG)  # loading finishes a swap the kill interrupted
        expected = 2 if _made_new_complete(read_mutation_log(log_path)) else 1
        assert version == expected, f"kill point {kill_after}: loaded version {version}, its log says {expected}"
        if version == 2:
            swapped_at = kill_after if swapped_at is None else swapped_at
        assert nxd.verify(ckpt, TAG).ok
        assert nxd.list_checkpoint_tags(ckpt) == [TAG]
        if kill_after % 3 == 0:  # (every third point, for time) the next save cleans up and re-saving works
            assert run_resave(ckpt, TAG, version=3, options=options) > 0
            assert _load(ckpt) == 3 and _hidden(ckpt) == [] and nxd.verify(ckpt, TAG).ok
        shutil.rmtree(ckpt)
        os.unlink(log_path)
    assert swapped_at is not None and swapped_at > mutations // 2
    print(f"\n[re-save] {mutations} kill points, the new version is loadable from kill point {swapped_at} on")


def test_resave_writes_beside_and_leaves_nothing_behind(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    nxd.save_checkpoint(ckpt, TAG, model=model_state(1), optimizer=optimizer_state(1), user_content={"version": 1})
    nxd.save_checkpoint(ckpt, "step_8", model=model_state(5), optimizer=optimizer_state(5), user_content={"version": 5})
    nxd.save_checkpoint(ckpt, TAG, model=model_state(2), optimizer=optimizer_state(2), user_content={"version": 2})
    assert _load(ckpt) == 2  # the re-saved tag is the newest, as with NxD's same-tag overwrite
    assert nxd.list_checkpoint_tags(ckpt) == ["step_8", TAG] and _hidden(ckpt) == []
    assert sorted(os.listdir(os.path.join(ckpt, TAG))) == sorted(os.listdir(os.path.join(ckpt, "step_8")))


def test_an_unfinished_resave_is_dropped_and_a_finished_one_swapped_in(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    nxd.save_checkpoint(ckpt, TAG, model=model_state(1), optimizer=optimizer_state(1), user_content={"version": 1})
    staged = str(tmp_path / "staged")
    nxd.save_checkpoint(staged, TAG, model=model_state(2), optimizer=optimizer_state(2), user_content={"version": 2})
    # A complete re-save whose swap never happened (crash right after its 'done'): a load swaps it in.
    shutil.copytree(os.path.join(staged, TAG), os.path.join(ckpt, layout.resave_dir(TAG)))
    assert _load(ckpt) == 2 and _hidden(ckpt) == []
    # An unfinished one (no 'done'): loads leave it alone (another job may be writing it); the next save drops it.
    shutil.copytree(os.path.join(staged, TAG), os.path.join(ckpt, layout.resave_dir(TAG)))
    os.unlink(os.path.join(ckpt, layout.resave_dir(TAG), layout.DONE_MARKER))
    assert _load(ckpt) == 2 and _hidden(ckpt) == [layout.resave_dir(TAG)]
    nxd.save_checkpoint(ckpt, "step_9", model=model_state(3), optimizer=optimizer_state(3), user_content={"version": 3})
    assert _hidden(ckpt) == [] and _load(ckpt, TAG) == 2
    # The swap's middle (old copy renamed away, new one not yet in place): a load finishes it.
    shutil.copytree(os.path.join(staged, TAG), os.path.join(ckpt, layout.resave_dir(TAG)))
    os.rename(os.path.join(ckpt, TAG), os.path.join(ckpt, layout.replaced_dir(TAG)))
    assert _load(ckpt, TAG) == 2 and _hidden(ckpt) == []


def test_the_old_copy_an_exchange_leaves_is_deleted_not_swapped_back(tmp_path):
    ckpt, old = str(tmp_path / "ckpt"), str(tmp_path / "old")
    nxd.save_checkpoint(old, TAG, model=model_state(1), optimizer=optimizer_state(1), user_content={"version": 1})
    nxd.save_checkpoint(ckpt, TAG, model=model_state(2), optimizer=optimizer_state(2), user_content={"version": 2})
    # A crash right after the atomic exchange: the tag holds the new checkpoint, the hidden directory the old one.
    shutil.copytree(os.path.join(old, TAG), os.path.join(ckpt, layout.resave_dir(TAG)))
    assert _load(ckpt) == 2
    nxd.save_checkpoint(ckpt, "step_9", model=model_state(3), optimizer=optimizer_state(3), user_content={"version": 3})
    assert _hidden(ckpt) == [] and _load(ckpt, TAG) == 2


def test_resave_without_atomic_exchange_uses_two_renames(tmp_path, monkeypatch):
    """Filesystems without renameat2(RENAME_EXCHANGE) (e.g. some network filesystems) rename twice."""
    from nxd_ckpt.storage import LocalStorage

    monkeypatch.setattr(LocalStorage, "exchange_dirs", lambda self, a, b: False)
    ckpt = str(tmp_path / "ckpt")
    for version in (1, 2):
        nxd.save_checkpoint(
            ckpt, TAG, model=model_state(version), optimizer=optimizer_state(version), user_content={"version": version}
        )
    assert _load(ckpt) == 2 and _hidden(ckpt) == [] and nxd.verify(ckpt, TAG).ok
