"""``nxd-ckpt verify`` / ``inspect`` / ``list`` on one checkpoint folder named itself: a DCP folder (the
``checkpoint_id`` a user hands ``dcp.load``) and a Hugging Face safetensors folder (written by the ``safetensors``
package as the Hub's are, with or without the library's manifests); each says what it checked."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

import nxd_ckpt
import nxd_ckpt.dcp
from nxd_ckpt.cli import main
from nxd_ckpt.format.manifests import record_files, write_manifest
from nxd_ckpt.storage import storage_for

pytestmark = pytest.mark.device_independent  # host files only: runs once, in the CPU lane

INDEX = "model.safetensors.index.json"


def _cli(capsys, *args: str, check: int = 0) -> tuple[str, str]:
    status = main(list(args))
    out, err = capsys.readouterr()
    assert status == check, f"exit {status}\nstdout:\n{out}\nstderr:\n{err}"
    return out, err


def _save_dcp(folder: Path, step: int, *, stock: bool = False) -> None:
    state = {"model": {"w": torch.full((64, 8), float(step))}, "train_state": {"step": step}}
    writer = dcp.FileSystemWriter(folder) if stock else nxd_ckpt.dcp.StorageWriter(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=writer)


def _save_hf(folder: Path, *, manifest: bool = False) -> dict[str, torch.Tensor]:
    """A two-file set as the Hub holds one: model-0000i-of-00002.safetensors and the index (its total_size, its
    weight_map); ``manifest``: the library's manifest of every file too (as its own HF writer records them)."""
    folder.mkdir(parents=True)
    tensors = {
        "model.embed_tokens.weight": torch.arange(256, dtype=torch.float32).reshape(32, 8),
        "model.layers.0.mlp.up_proj.weight": torch.ones(16, 8, dtype=torch.bfloat16),
        "model.norm.weight": torch.full((8,), 2.0),
    }
    shards = {
        "model-00001-of-00002.safetensors": ["model.embed_tokens.weight"],
        "model-00002-of-00002.safetensors": ["model.layers.0.mlp.up_proj.weight", "model.norm.weight"],
    }
    for file, names in shards.items():
        save_file({n: tensors[n] for n in names}, folder / file, metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
        "weight_map": {n: file for file, names in shards.items() for n in names},
    }
    (folder / INDEX).write_text(json.dumps(index, indent=2))
    if manifest:
        storage = storage_for(str(folder.parent))
        write_manifest(storage, folder.name, 0, record_files(storage, folder.name, [*shards, INDEX]))
    return tensors


@pytest.fixture
def ck(tmp_path) -> Path:
    """A TorchTitan checkpoint folder: step-1, step-2 by our writer, step-3 by stock DCP, step-4 an HF set."""
    for step in (1, 2):
        _save_dcp(tmp_path / f"step-{step}", step)
    _save_dcp(tmp_path / "step-3", 3, stock=True)
    _save_hf(tmp_path / "step-4")
    return tmp_path


def test_verify_takes_the_dcp_folder_itself(ck, capsys):
    """`verify ck/step-2` is `verify ck --tag step-2` (it used to fail: "it holds no tag folder")."""
    named, _ = _cli(capsys, "verify", str(ck / "step-2"))
    by_tag, _ = _cli(capsys, "verify", str(ck), "--tag", "step-2")
    assert named == by_tag and named.startswith("step-2: OK: 2 files checked by checksums from 1 manifests")
    doc = json.loads(_cli(capsys, "verify", str(ck / "step-2"), "--json")[0])
    assert doc["ok"] and [t["tag"] for t in doc["tags"]] == ["step-2"] and doc["format"] == "dcp"
    damaged = ck / "step-2" / "__0_0.distcp"
    data = bytearray(damaged.read_bytes())
    data[-300] ^= 0x01
    damaged.write_bytes(bytes(data))
    out, err = _cli(capsys, "verify", str(ck / "step-2") + "/", check=1)
    assert f"{damaged} is corrupt" in err and out.startswith("step-2: FAILED")


def test_verify_of_a_stock_dcp_folder_says_only_sizes_were_checked(ck, capsys):
    out, err = _cli(capsys, "verify", str(ck / "step-3"))
    assert out.startswith("step-3: OK") and "sizes only, no checksums" in out
    assert "the contents could not be verified" in err


def test_inspect_and_list_take_the_dcp_folder_itself(ck, capsys):
    doc = json.loads(_cli(capsys, "inspect", str(ck / "step-1"), "--json")[0])
    entries = {e["fqn"]: e for e in doc["entries"]}
    assert entries["model.w"]["shape"] == [64, 8] and doc["manifests"] == 1
    doc = json.loads(_cli(capsys, "list", str(ck / "step-1"), "--json")[0])
    assert [(t["tag"], t["format"], t["complete"], t["checksums"]) for t in doc["tags"]] == [
        ("step-1", "dcp", True, True)
    ]
    out, _ = _cli(capsys, "list", str(ck / "step-3"))
    assert "step-3  dcp     complete, latest" in out and "none (stock DCP)" in out


def test_a_folder_with_tag_or_prune_is_refused_naming_the_command_that_works(ck, capsys):
    _, err = _cli(capsys, "verify", str(ck / "step-2"), "--tag", "step-1", check=1)
    assert "one checkpoint folder" in err and f"nxd-ckpt verify {ck} --tag step-1" in err
    _, err = _cli(capsys, "prune", str(ck / "step-2"), "--keep", "1", check=1)
    assert f"nxd-ckpt prune {ck}" in err
    assert sorted(os.listdir(ck)) == ["step-1", "step-2", "step-3", "step-4"]


def test_verify_of_a_downloaded_hf_folder_checks_headers_and_says_so(tmp_path, capsys):
    folder = tmp_path / "llama"
    _save_hf(folder)
    out, err = _cli(capsys, "verify", str(folder))
    assert out.startswith("llama: OK: 3 files checked by every safetensors header and tensor byte range")
    assert "no checksums" in out and "the tensor bytes themselves could not be verified" in err
    doc = json.loads(_cli(capsys, "verify", str(folder), "--json")[0])
    assert doc["format"] == "hf" and doc["ok"] and doc["tags"][0]["manifests"] == 0


def test_a_truncated_shard_is_named(tmp_path, capsys):
    folder = tmp_path / "llama"
    _save_hf(folder)
    shard = folder / "model-00002-of-00002.safetensors"
    os.truncate(shard, shard.stat().st_size - 4)
    out, err = _cli(capsys, "verify", str(folder), check=1)
    assert f"{shard} has an invalid safetensors header" in err and "point past the end" in err
    assert "the shard is damaged: restore it from a copy or download it again" in err
    assert "model-00001" not in err and out.startswith("llama: FAILED (1 problems)")
    _, err = _cli(capsys, "inspect", str(folder), check=1)
    assert str(shard) in err


def test_bytes_after_the_last_tensor_are_named_as_a_load_would(tmp_path, capsys):
    """``verify`` runs the checks an initial load runs (``tools.hf_folder``): a shard whose header leaves bytes
    after its last tensor parses, but the header does not describe the file, and the two agree on the message."""
    from nxd_ckpt.tools.hf_folder import check_folder

    folder = tmp_path / "llama"
    _save_hf(folder)
    shard = folder / "model-00001-of-00002.safetensors"
    with open(shard, "ab") as f:
        f.write(b"\0" * 8)
    _, err = _cli(capsys, "verify", str(folder), check=1)
    assert f"{shard} has {shard.stat().st_size} bytes but its header describes {shard.stat().st_size - 8}" in err
    with pytest.raises(nxd_ckpt.IntegrityError) as e:
        check_folder(str(folder), None)
    assert f"nxd-ckpt: problem: {e.value}" in err


def test_a_header_pointing_past_its_file_is_named(tmp_path, capsys):
    folder = tmp_path / "llama"
    _save_hf(folder)
    shard = folder / "model-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[0:8] = struct.pack("<Q", len(data))  # a header length past the end of the file
    shard.write_bytes(bytes(data))
    _, err = _cli(capsys, "verify", str(folder), check=1)
    assert f"{shard} is not a safetensors file (header length" in err


def test_the_index_is_checked_against_the_files(tmp_path, capsys):
    folder = tmp_path / "llama"
    _save_hf(folder)
    index = json.loads((folder / INDEX).read_text())
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00002.safetensors"  # it is in the second file
    index["weight_map"]["lm_head.weight"] = "model-00003-of-00002.safetensors"
    (folder / INDEX).write_text(json.dumps(index))
    _, err = _cli(capsys, "verify", str(folder), check=1)
    assert f"{folder}/model-00003-of-00002.safetensors is missing ({folder}/{INDEX} maps tensors to it)" in err
    assert "maps model.norm.weight to model-00001-of-00002.safetensors, but it is in model-00002" in err


def test_an_hf_folder_with_manifests_is_verified_by_checksum(tmp_path, capsys):
    folder = tmp_path / "export"
    _save_hf(folder, manifest=True)
    out, _ = _cli(capsys, "verify", str(folder))
    assert out.startswith("export: OK: 3 files checked by checksums from 1 manifests and every safetensors header")
    shard = folder / "model-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x01  # inside a tensor: the header still parses
    shard.write_bytes(bytes(data))
    _, err = _cli(capsys, "verify", str(folder), check=1)
    assert f"{shard} is corrupt" in err
    (folder / "nxd_ckpt" / "manifest_rank_00000.json").unlink()
    out, _ = _cli(capsys, "verify", str(folder))  # without checksums the flip cannot be seen, and it says so
    assert "no checksums" in out


def test_inspect_and_list_of_an_hf_folder(tmp_path, capsys):
    folder = tmp_path / "llama"
    tensors = _save_hf(folder)
    doc = json.loads(_cli(capsys, "inspect", str(folder), "--json")[0])
    assert doc["format"] == "hf" and doc["index"] and doc["manifests"] == 0
    assert {t["name"]: (t["dtype"], t["shape"], t["file"]) for t in doc["tensors"]} == {
        "model.embed_tokens.weight": ("float32", [32, 8], "model-00001-of-00002.safetensors"),
        "model.layers.0.mlp.up_proj.weight": ("bfloat16", [16, 8], "model-00002-of-00002.safetensors"),
        "model.norm.weight": ("float32", [8], "model-00002-of-00002.safetensors"),
    }
    assert sum(t["nbytes"] for t in doc["tensors"]) == sum(t.numel() * t.element_size() for t in tensors.values())
    out, _ = _cli(capsys, "inspect", str(folder))
    assert "Hugging Face safetensors, 3 tensors in 2 files" in out and "model.norm.weight" in out
    out, _ = _cli(capsys, "list", str(folder))
    assert "llama   hf      complete, latest" in out and "none (safetensors, no checksums)" in out


def test_a_single_file_hf_folder_and_an_unfinished_set(tmp_path, capsys):
    single = tmp_path / "single"
    single.mkdir()
    save_file({"w": torch.ones(4, 4)}, single / "model.safetensors")
    out, _ = _cli(capsys, "verify", str(single))
    assert out.startswith("single: OK: 1 files checked by every safetensors header")
    unfinished = tmp_path / "unfinished"
    _save_hf(unfinished)
    (unfinished / INDEX).unlink()  # the index is written last: a set without it is a save that never finished
    _, err = _cli(capsys, "verify", str(unfinished), check=1)
    assert f"{unfinished} has neither {INDEX} nor model.safetensors" in err


def test_a_directory_whose_last_step_is_hf(ck, capsys):
    """TorchTitan's last_save_in_hf: step-4 is a safetensors set; it is the latest, verified as HF, and a prune
    deletes it like any other folder."""
    doc = json.loads(_cli(capsys, "list", str(ck), "--json")[0])
    assert doc["latest"] == "step-4"
    assert [(t["tag"], t["format"], t["complete"]) for t in doc["tags"]] == [
        ("step-1", "dcp", True), ("step-2", "dcp", True), ("step-3", "dcp", True), ("step-4", "hf", True),
    ]  # fmt: skip
    out, _ = _cli(capsys, "verify", str(ck))
    assert out.startswith("step-4: OK: 3 files checked by every safetensors header")
    out, _ = _cli(capsys, "verify", str(ck), "--all")
    assert [line.split(":")[0] for line in out.splitlines()] == ["step-1", "step-2", "step-3", "step-4"]
    _cli(capsys, "prune", str(ck), "--keep", "1")
    assert sorted(os.listdir(ck)) == ["step-4"]


def test_list_of_an_hf_folder_does_not_import_torch(ck):
    code = (
        "import sys\nfrom nxd_ckpt.cli import main\nassert main(sys.argv[1:]) == 0\n"
        "print('TORCH_IMPORTED' if 'torch' in sys.modules else 'TORCH_NOT_IMPORTED')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(nxd_ckpt.__file__).parent.parent)}
    for target in (ck, ck / "step-4", ck / "step-2"):
        proc = subprocess.run([sys.executable, "-c", code, "list", str(target)], capture_output=True, text=True,
                              timeout=120, env=env)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.rstrip().endswith("TORCH_NOT_IMPORTED"), proc.stdout[-300:]
        assert target != ck / "step-4" or "step-4  hf      complete, latest" in proc.stdout, proc.stdout


def test_safetensors_beside_tags_or_steps_are_no_checkpoint_folder(ck, tmp_path_factory, capsys):
    """An export into a directory of the library's tags leaves it a directory of tags; an HF folder not named
    step-N beside TorchTitan's steps is no step: not listed, never pruned."""
    import nxd_ckpt as nxd

    tags_dir = tmp_path_factory.mktemp("nxd")
    nxd.save_checkpoint(tags_dir, "step_1", model={"w": torch.zeros(4)})
    save_file({"w": torch.zeros(4)}, tags_dir / "model.safetensors")
    doc = json.loads(_cli(capsys, "list", str(tags_dir), "--json")[0])
    assert [t["tag"] for t in doc["tags"]] == ["step_1"] and "format" not in doc
    _save_hf(ck / "exported")
    doc = json.loads(_cli(capsys, "list", str(ck), "--json")[0])
    assert "exported" not in [t["tag"] for t in doc["tags"]]
    _cli(capsys, "prune", str(ck), "--keep", "1")
    assert sorted(os.listdir(ck)) == ["exported", "step-4"]
    out, _ = _cli(capsys, "verify", str(ck / "exported"))  # named itself, it is an HF folder
    assert out.startswith("exported: OK")
