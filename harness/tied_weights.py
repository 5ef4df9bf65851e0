"""A scenario for tied weights on any device (a native accelerator, the fake one, XLA): an embedding tied to the output
layer, whose two ``state_dict()`` entries are two tensor objects over one storage. An async save must clone it on the
device and move it to the host once, write the files a synchronous save writes (each key a tensor of its own, as NxD
writes them), and load back bit for bit with the tie intact."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

import nxd_ckpt as nxd
from harness.held_transfer import host_copy
from nxd_ckpt import xla
from nxd_ckpt.device.backend import nbytes, on_device
from nxd_ckpt.device.snapshot import DeviceCopies
from nxd_ckpt.device.transfer import DeviceTransfer
from nxd_ckpt.testing.fakes import assert_state_equal
from nxd_ckpt.tree import iter_tensors

VOCAB = 96
WIDTH = 32


class TiedLM(nn.Module):
    """Embedding -> linear -> output layer whose weight is the embedding's (tied, as in most language models)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.body = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.tie()

    def tie(self) -> None:
        """The output layer uses the embedding's weight (again after ``.to``, which may part them)."""
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(tokens))))


def training(device: Any) -> tuple[TiedLM, torch.optim.Optimizer]:
    """The same tied model (seeded) and AdamW on ``device``."""
    torch.manual_seed(0)
    model = TiedLM().to(device)
    model.tie()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step(model: TiedLM, opt: torch.optim.Optimizer, seed: int) -> None:
    """One optimizer step (every parameter and moment changes in place), synced on XLA."""
    device = model.embed.weight.device
    tokens = torch.randint(0, VOCAB, (8, 4), generator=torch.Generator().manual_seed(seed)).to(device)
    loss = nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), tokens.reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    xla.mark_step()


def distinct_device_tensors(model: TiedLM, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The device tensors a save must copy, each once: the parameters (the tied one once) and the moments."""
    params = list(model.parameters())  # the tied parameter is one object here
    moments = [t for _, t in iter_tensors(opt.state_dict()["state"]) if on_device(t)]
    return params + moments


class Counted:
    """Counts, while active, the device tensors cloned and the bytes a ``DeviceTransfer`` (or, under a host memory
    budget, ``DeviceCopies.fetch``) brings to the host."""

    def __init__(self, monkeypatch: Any) -> None:
        self.clones = 0
        self.moved_bytes = 0
        real_clone, real_chunk, real_fetch = torch.Tensor.clone, DeviceTransfer._copy_chunk, DeviceCopies.fetch

        def clone(t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            self.clones += on_device(t)
            return real_clone(t, *args, **kwargs)

        def chunk(transfer: DeviceTransfer, sources: list[torch.Tensor]) -> list[torch.Tensor]:
            self.moved_bytes += sum(nbytes(s) for s in sources)
            return real_chunk(transfer, sources)

        def fetch(copies: DeviceCopies, sources: Any) -> list[torch.Tensor]:
            self.moved_bytes += sum(nbytes(s) for s in sources)
            return real_fetch(copies, sources)

        monkeypatch.setattr(torch.Tensor, "clone", clone)
        monkeypatch.setattr(DeviceTransfer, "_copy_chunk", chunk)
        monkeypatch.setattr(DeviceCopies, "fetch", fetch)


def state_files(root: str) -> dict[str, bytes]:
    """Every tensor file of a tag (relative path -> bytes): what the state looks like on disk, without the tag's
    metadata, markers and manifests (which hold times and checksums of their own)."""
    out: dict[str, bytes] = {}
    for folder, _, names in os.walk(root):
        for name in names:
            if name.endswith((".pt", ".tensor")) or "tensors" in folder:
                path = os.path.join(folder, name)
                with open(path, "rb") as f:
                    out[os.path.relpath(path, root)] = f.read()
    return out


def assert_keys_apart(tag_dir: str) -> None:
    """The tag's model file holds each of the tied keys as a tensor of its own (NxD moves each key to the host by
    itself, and so does a synchronous save), not one storage shared by both."""
    folder = os.path.join(tag_dir, "model")
    (name,) = [n for n in os.listdir(folder) if n.endswith(".pt")]
    saved = torch.load(os.path.join(folder, name), weights_only=False)  # small tensors: inline in xser too
    embed, head = saved["embed.weight"], saved["head.weight"]
    assert torch.equal(embed, head), "the tied keys were saved with different values"
    assert embed.untyped_storage().data_ptr() != head.untyped_storage().data_ptr(), "the tied keys share a storage"


def saved_once_and_loaded_tied(
    path: str, device: Any, monkeypatch: Any, use_xser: bool, **save_keywords: Any
) -> nxd.SaveReport:
    """An async save of the tied model clones and moves each storage once, writes the files a synchronous save of
    the same state writes, and loads back bit for bit with the tie intact. ``save_keywords``: e.g. a host memory
    budget (the device copies then travel through ``DeviceCopies.fetch``)."""
    model, opt = training(device)
    step(model, opt, seed=1)
    expected_model, expected_opt = host_copy(model.state_dict()), host_copy(opt.state_dict())
    distinct = distinct_device_tensors(model, opt)
    with monkeypatch.context() as patched:
        counted = Counted(patched)
        report = nxd.save_checkpoint(
            path, "async", model=model, optimizer=opt, async_save=True, use_xser=use_xser, **save_keywords
        )
        clones = counted.clones
        report.wait()
    assert clones == len(distinct), f"{clones} device tensors cloned, {len(distinct)} distinct ones"
    distinct_bytes = sum(nbytes(t) for t in distinct)
    assert report.device_snapshot_bytes == counted.moved_bytes == distinct_bytes, (
        f"snapshot {report.device_snapshot_bytes} bytes, moved {counted.moved_bytes}, distinct {distinct_bytes}"
    )
    nxd.save_checkpoint(path, "sync", model=model, optimizer=opt, use_xser=use_xser)
    nxd.finalize_checkpoint()
    written = state_files(os.path.join(path, "async"))
    assert written and written == state_files(os.path.join(path, "sync")), "async and sync files differ"
    assert_keys_apart(os.path.join(path, "async"))

    model2, opt2 = training(device)
    step(model2, opt2, seed=9)  # state to overwrite
    nxd.load_checkpoint(path, "async", model=model2, optimizer=opt2)
    assert model2.head.weight is model2.embed.weight, "the load parted the tied weights"
    assert_state_equal(host_copy(model2.state_dict()), expected_model)
    assert_state_equal(host_copy(opt2.state_dict())["state"], expected_opt["state"])
    return report
