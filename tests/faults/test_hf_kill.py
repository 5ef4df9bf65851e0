"""The TorchTitan manager's Hugging Face last step (``last_save_in_hf=True``) SIGKILLed at every filesystem mutation
(a file opened for writing, rename, fsync, unlink, mkdir, rmdir) never leaves a folder that looks complete and is
partial.

"Looks complete" is TorchTitan's own step scan: any folder whose name ``re.search``-matches ``step-N`` (hidden ones
too) holding ``model.safetensors.index.json``. Each such folder must read whole, as ``transformers`` reads it (the
index, then every file with ``safetensors``), bit-exactly as the old or the new version. Two cases: the last step
saved into a new folder, and saved again into ``step-5`` holding an older version in another file layout (a job
restarted after its end). After each kill the next save settles what the kill left and leaves nothing hidden.
"""

from __future__ import annotations

import os
import shutil

import pytest

pytest.importorskip(
    "torchtitan", reason="needs the torchtitan extra (pip install 'nxd-ckpt[torchtitan]', Python >= 3.11)"
)

from harness import titan_hf
from nxd_ckpt.format.layout import HF_COMMIT
from nxd_ckpt.tools.hf_folder import check_folder

pytestmark = [pytest.mark.device_independent, pytest.mark.slow]

STEP_DIR = f"step-{titan_hf.STEP}"


def _outcome(ckpt: str, versions: tuple[int, ...]) -> str:
    """'old', 'new' (what step-N loads as), 'none' (no step-N that looks complete, nothing lost), or 'partial: ...'
    when a folder that looks complete does not read whole as one of ``versions``."""
    for name in titan_hf.complete_looking(ckpt):
        folder = os.path.join(ckpt, name)
        if titan_hf.folder_version(folder, versions) is None:
            return f"partial: {name}"
        check_folder(folder, None)  # our initial load's checks agree: its manifests match
    version = titan_hf.folder_version(os.path.join(ckpt, STEP_DIR), versions)
    if version is None:
        return "none"
    return "new" if version == versions[-1] else "old"


def _kill_at_every_mutation(tmp_path: str, case: str, kind: str = "ours") -> list[str]:
    """The outcome of a kill at each mutation of ``kind``'s save (ours: then the recovery by the next save)."""
    base = os.path.join(tmp_path, f"{kind}-{case}")
    names = titan_hf.hf_names(titan_hf.model(0))
    assets = titan_hf.write_assets(os.path.join(base, "assets"), names, 3)
    pristine = os.path.join(base, "pristine")
    os.makedirs(pristine)
    versions: tuple[int, ...] = (2,)
    if case == "resave":  # step-5 holds version 1 in 3 files; version 2 is one file
        assert titan_hf.run_hf_save(pristine, assets, 1, kind=kind) > 0
        versions = (1, 2)
    full = os.path.join(base, "full")
    shutil.copytree(pristine, full)
    layout = None if kind == "ours" else assets  # TorchTitan's own re-save needs the same file layout (below)
    mutations = titan_hf.run_hf_save(full, layout, 2, kind=kind)
    assert _outcome(os.path.join(full, "ckpt"), versions) == "new"
    outcomes = []
    for kill_after in range(mutations):
        root = os.path.join(base, f"k{kill_after}")
        shutil.copytree(pristine, root)
        assert titan_hf.run_hf_save(root, layout, 2, kill_after=kill_after, kind=kind) == -1
        ckpt = os.path.join(root, "ckpt")
        outcomes.append(_outcome(ckpt, versions))
        if kind != "ours":
            shutil.rmtree(root)
            continue
        if case == "resave" and outcomes[-1] == "none":  # between the two renames: the old copy is kept aside
            assert titan_hf.folder_version(os.path.join(ckpt, HF_COMMIT.replaced_dir(STEP_DIR)), versions) == 1
        if kill_after % 3 == 0:  # (every third point, for time) the next save settles what the kill left
            assert titan_hf.run_hf_save(root, None, 3) > 0
            assert titan_hf.folder_version(os.path.join(ckpt, STEP_DIR), (3,)) == 3
            assert sorted(os.listdir(ckpt)) == [STEP_DIR], kill_after
        shutil.rmtree(root)
    return outcomes


@pytest.mark.parametrize("case", ["new_folder", "resave"])
def test_a_killed_hf_save_never_leaves_a_partial_folder_that_looks_complete(tmp_path, case, capsys):
    outcomes = _kill_at_every_mutation(str(tmp_path), case)
    with capsys.disabled():
        counts = {o: outcomes.count(o) for o in sorted(set(outcomes))}
        print(f"\nHugging Face last step ({case}) SIGKILLed at each of {len(outcomes)} mutations: {counts}")
    assert len(outcomes) >= 20
    assert [o for o in outcomes if o.startswith("partial")] == []
    assert outcomes[-1] == "new"  # once committed, the new one stays
    if case == "resave":
        assert "old" in outcomes and outcomes.count("none") <= 2  # the old copy stays until the swap


def test_the_kills_reach_what_torchtitans_own_hf_save_leaves_partial(tmp_path, capsys):
    """The same kills of TorchTitan's own manager re-saving step-5 (its consolidated files rewritten in place
    under the old index) leave folders that look complete and are partial: the test sees what it guards against.
    (Its re-save in another file layout is wrong even without a kill: the old ``sharded/`` files stay and are
    consolidated with the new ones; so both of its saves here use one layout.)"""
    outcomes = _kill_at_every_mutation(str(tmp_path), "resave", kind="theirs")
    partial = [o for o in outcomes if o.startswith("partial")]
    with capsys.disabled():
        print(f"\nTorchTitan's own manager, re-save SIGKILLed at each of {len(outcomes)} mutations: "
              f"{len(partial)} partial folders that look complete")  # fmt: skip
    assert partial
