"""Hugging Face checkpoints of a small TorchTitan job: a model, a state-dict adapter built on TorchTitan's own
``StateDictAdapter`` (its ``fqn_to_index_mapping`` read from ``hf_assets_path``'s index by TorchTitan's code),
either checkpoint manager saving the last step with ``last_save_in_hf=True``, a forked save killed at its N-th
filesystem mutation, and a judge of what a folder then holds. Needs the ``torchtitan`` extra."""

from __future__ import annotations

import json
import os
import re
import signal
import warnings
from typing import Any

import torch
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

from harness.crashloop import _MUTATIONS, _kill_at_call
from harness.multiprocess import rank_context

INDEX = "model.safetensors.index.json"
STEP = 5
"""The last step every save here writes (``step-5``)."""


class TinyAdapter(StateDictAdapter):
    """A model's names to Hugging Face ones and back (``0.weight`` <-> ``model.layers.0.proj.weight``), 2-D weights
    transposed (new tensors, as Llama's adapter permutes the attention weights)."""

    def __init__(self, hf_assets_path: str | None = None) -> None:
        super().__init__(None, hf_assets_path)  # type: ignore[arg-type]  # the base reads only the index

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for key, value in state_dict.items():
            layer, param = key.split(".")
            out[f"model.layers.{layer}.proj.{param}"] = value.t().contiguous() if value.dim() == 2 else value
        return out

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for key, value in hf_state_dict.items():
            parts = key.split(".")
            out[f"{parts[2]}.{parts[4]}"] = value.t() if value.dim() == 2 else value
        return out


def model(seed: int, wide: int = 16) -> torch.nn.Module:
    """The job's model, its weights a function of ``seed``."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, wide),
        torch.nn.ReLU(),
        torch.nn.Linear(wide, wide),
        torch.nn.ReLU(),
        torch.nn.Linear(wide, 4),
    )


def hf_names(m: torch.nn.Module) -> list[str]:
    """The Hugging Face names of ``m``'s tensors, in state-dict order."""
    return list(TinyAdapter().to_hf(m.state_dict()))


def write_assets(folder: str, names: list[str], files: int) -> str:
    """An ``hf_assets_path`` whose index spreads ``names`` over ``files`` files, in order (TorchTitan reads the
    file numbers from it); returns ``folder``."""
    os.makedirs(folder, exist_ok=True)
    per = -(-len(names) // files)
    weight_map = {n: f"model-{i // per + 1:05d}-of-{files:05d}.safetensors" for i, n in enumerate(names)}
    with open(os.path.join(folder, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    return folder


def manager(config_class: Any, base: str, m: torch.nn.Module, assets: str | None, **fields: Any) -> Any:
    """``config_class``'s manager (TorchTitan's or ours) over ``m``, saving the last step in Hugging Face format
    (``export_dtype`` bf16 unless ``fields`` say otherwise), built with the trainer's keyword arguments."""
    fields = {"export_dtype": "bfloat16", "keep_latest_k": 0, **fields}
    config = config_class.Config(enable=True, folder="ckpt", last_save_in_hf=True, last_save_model_only=True, **fields)
    return build(config, base, m, assets)


def build(config: Any, base: str, m: torch.nn.Module, assets: str | None) -> Any:
    """The manager ``config`` describes (TorchTitan's or ours) over ``m`` alone, built with the trainer's keyword
    arguments and the Hugging Face adapter of ``assets``."""
    return config.build(
        dataloader=None,
        model_parts=[m],
        optimizers=None,
        lr_schedulers=None,
        states={},
        sd_adapter=TinyAdapter(assets),
        base_folder=base,
    )


def expected_hf(version: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors the save of ``version`` holds (the model of seed ``version`` in ``dtype``)."""
    state = {k: v.to(dtype) for k, v in model(version).state_dict().items()}
    return TinyAdapter().to_hf(state)


# ------------------------------------------------------------------------------------------ killed saves
def _save_child(base: str, assets: str | None, version: int, kill_after: int, kind: str) -> None:
    """A manager (``kind``: ``ours`` or TorchTitan's, ``theirs``) saves the last step of the model of seed
    ``version``, SIGKILLing this process at its ``kill_after``-th mutation (never, if negative); exit status 100 +
    the mutations a finished save made."""
    import torch.distributed as dist
    from torchtitan.components.checkpointer import CheckpointManager as TitanManager

    from nxd_ckpt.torchtitan import CheckpointManager

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ckpt = manager(CheckpointManager if kind == "ours" else TitanManager, base, model(version), assets)
    calls = _kill_at_call(kill_after, _MUTATIONS, None, write_opens=True)
    ckpt.save(STEP, last_step=True)
    os._exit(100 + min(calls[0], 150))


def run_hf_save(base: str, assets: str | None, version: int, kill_after: int = -1, kind: str = "ours") -> int:
    """Save the last step of ``version`` under ``base`` with ``kind``'s manager (``ours``, ``theirs``) in a forked
    process killed at its ``kill_after``-th mutation; the mutations a finished save made, or -1 when killed."""
    ctx = rank_context(__name__)
    p = ctx.Process(target=_save_child, args=(base, assets, version, kill_after, kind), daemon=True)
    p.start()
    p.join(timeout=120)
    if p.exitcode == -signal.SIGKILL:
        return -1
    if p.exitcode is None or p.exitcode < 100:
        raise AssertionError(f"Hugging Face saving process failed (exit code {p.exitcode})")
    return p.exitcode - 100


def complete_looking(ckpt_dir: str) -> list[str]:
    """The folders of ``ckpt_dir`` TorchTitan's step scan counts as checkpoints: a name ``re.search``-matching
    ``step-N`` (hidden ones too) holding the index."""
    if not os.path.isdir(ckpt_dir):
        return []
    return sorted(
        n
        for n in os.listdir(ckpt_dir)
        if re.search(r"step-(\d+)", n) and os.path.isfile(os.path.join(ckpt_dir, n, INDEX))
    )


def folder_version(folder: str, versions: tuple[int, ...]) -> int | None:
    """Which of ``versions`` the Hugging Face folder holds, bit-exactly, read as ``transformers`` reads it (the
    index, then each file with ``safetensors``); None when it holds none of them or does not read."""
    from safetensors.torch import load_file

    try:
        with open(os.path.join(folder, INDEX)) as f:
            weight_map = json.load(f)["weight_map"]
        got: dict[str, torch.Tensor] = {}
        for file in sorted(set(weight_map.values())):
            got.update(load_file(os.path.join(folder, file)))
    except Exception:
        return None
    if set(got) != set(weight_map):
        return None
    for version in versions:
        want = expected_hf(version)
        if want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want):
            return version
    return None
