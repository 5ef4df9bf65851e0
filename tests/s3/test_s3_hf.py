"""The TorchTitan manager's Hugging Face last step (``last_save_in_hf=True``) on s3:// (the loopback S3-protocol
server): the same objects, byte for byte, as the same save into a local folder, the index last; a complete folder
is never overwritten in place (S3 cannot rename folders)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

pytest.importorskip(
    "torchtitan.components.checkpointer", reason="needs the torchtitan extra (pip install 'nxd-ckpt[torchtitan]')"
)

from harness import titan_hf, titan_job
from nxd_ckpt.errors import CheckpointError
from nxd_ckpt.storage.s3 import S3Storage
from nxd_ckpt.torchtitan import CheckpointManager

pytestmark = [pytest.mark.s3, pytest.mark.device_independent]


@pytest.fixture(scope="module", autouse=True)
def _gloo_world_of_one() -> Iterator[None]:
    with titan_job.gloo_world_of_one():
        yield


def test_the_last_step_on_s3_is_the_local_one_and_is_not_overwritten_in_place(s3_url, tmp_path):
    assets = titan_hf.write_assets(str(tmp_path / "assets"), titan_hf.hf_names(titan_hf.model(0)), 2)
    titan_hf.manager(CheckpointManager, str(tmp_path / "local"), titan_hf.model(0), assets).save(5, last_step=True)
    titan_hf.manager(CheckpointManager, s3_url, titan_hf.model(0), assets).save(5, last_step=True)
    local = str(tmp_path / "local" / "ckpt" / "step-5")
    bucket = S3Storage(f"{s3_url}/ckpt")
    names = sorted(p.removeprefix("step-5/") for p in bucket.walk_files("step-5"))
    assert names == sorted(os.path.relpath(os.path.join(d, n), local) for d, _, files in os.walk(local) for n in files)
    assert names == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "nxd_ckpt/manifest_rank_00000.json",
    ]
    for name in names:
        with open(os.path.join(local, name), "rb") as f:
            assert bucket.read_bytes(f"step-5/{name}") == f.read(), name
    again = titan_hf.manager(CheckpointManager, s3_url, titan_hf.model(1), assets)
    with pytest.raises(CheckpointError, match="already holds a complete Hugging Face checkpoint"):
        again.save(5, last_step=True)
    with open(os.path.join(local, "model-00001-of-00002.safetensors"), "rb") as f:
        assert bucket.read_bytes("step-5/model-00001-of-00002.safetensors") == f.read()  # the old one stays
