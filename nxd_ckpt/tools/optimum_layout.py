"""optimum-neuron's consolidation rules, read from the metadata it saves, for ``nxd-ckpt export``.

optimum-neuron's ``save_pretrained`` writes ``<tag>/mp_metadata_pp_rank_{pp}.json`` beside NxD's state files:
``parameters`` (each parameter's ``tensor_model_parallel`` / ``partition_dim``) and
``model_weight_transformation_specs`` (how its fused modules map back to the Transformers model's weights). Its
consolidation (``optimum-cli neuron consolidate``, ``models/training/checkpointing.py``) concatenates the TP shards
of each parameter along ``partition_dim`` and applies the specs; ``OptimumModel`` gives ``export`` the same tensors
under the same names. Supported specs: ``FusedLinearsSpec`` (e.g. ``gate_up_proj`` -> ``gate_proj``, ``up_proj``);
others (fused or multiplied GQA QKV projections, LoRA adapters) raise ``ExportNotSupportedError``: consolidate
those with optimum-neuron.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from nxd_ckpt.errors import CheckpointError, FormatError
from nxd_ckpt.format import layout
from nxd_ckpt.inspection import Checkpoint
from nxd_ckpt.tools.model_source import CheckpointModel, ShardingSource
from nxd_ckpt.tools.safetensors_io import TensorEntry


class ExportNotSupportedError(CheckpointError):
    """The checkpoint's model state cannot be written in the requested form (``tools.export`` raises it too)."""


@dataclass(frozen=True)
class FusedLinears:
    """One ``FusedLinearsSpec``: ``fused`` holds ``linears`` stacked along ``axis`` on every TP rank."""

    module: str
    fused: str
    linears: tuple[str, ...]
    dims: tuple[int, ...]
    axis: int
    bias: bool

    def params(self) -> list[str]:
        return ["weight", "bias"] if self.bias else ["weight"]


@dataclass(frozen=True)
class OptimumMetadata:
    """The metadata of every PP stage of one optimum-neuron tag, merged."""

    parameters: dict[str, dict[str, Any]]
    fused: list[FusedLinears]

    def sharding(self) -> dict[str, int | None]:
        """The sharding optimum-neuron's consolidation applies (a spec for ``CheckpointModel``): each parameter
        concatenated along its ``partition_dim`` (stride ignored, as it does), everything else replicated."""
        return {
            name: (int(m["partition_dim"]) if m.get("tensor_model_parallel") else None)
            for name, m in self.parameters.items()
        } | {"*": None}


def read_metadata(ckpt: Checkpoint) -> OptimumMetadata | None:
    """optimum-neuron's metadata of ``ckpt``, or None when the tag has none (not an optimum-neuron save)."""
    stages = sorted(
        pp for name in ckpt.storage.list_dir(ckpt.tag) if (pp := layout.parse_optimum_metadata_name(name)) is not None
    )
    if not stages:
        return None
    parameters: dict[str, dict[str, Any]] = {}
    fused: list[FusedLinears] = []
    for pp in stages:
        path = layout.optimum_metadata_file(ckpt.tag, pp)
        try:
            doc = json.loads(ckpt.storage.read_bytes(path))
            parameters.update(doc["parameters"])
            for module in doc["model_weight_transformation_specs"]:
                fused += [_spec(module["module_fully_qualified_name"], kind, args) for kind, args in module["specs"]]
        except (ValueError, KeyError, TypeError) as e:
            raise FormatError(f"{ckpt.storage.url}/{path} is not optimum-neuron's consolidation metadata: {e}") from e
    return OptimumMetadata(parameters, fused)


def _spec(module: str, kind: str, args: dict[str, Any]) -> FusedLinears:
    if kind != "FusedLinearsSpec" or args.get("peft_type") is not None:
        what = f"{kind} with {args['peft_type']} adapters" if args.get("peft_type") else kind
        raise ExportNotSupportedError(
            f"optimum-neuron's {what} (module {module!r}) is not reproduced by nxd-ckpt export; consolidate this "
            "checkpoint with `optimum-cli neuron consolidate`"
        )
    return FusedLinears(
        module=module,
        fused=args["fused_linear_name"],
        linears=tuple(args["linear_names"]),
        dims=tuple(int(d) for d in args["original_dims"]),
        axis=int(args["fuse_axis"]),
        bias=bool(args["bias"]),
    )


class OptimumModel:
    """A tag's model state as optimum-neuron's consolidation produces it: ``entries()``, ``read(name)``,
    ``skipped`` (the ``CheckpointModel`` surface ``export`` uses)."""

    def __init__(self, ckpt: Checkpoint, meta: OptimumMetadata, sharding: ShardingSource = None, **kw: Any) -> None:
        self.model = CheckpointModel(ckpt, sharding if sharding is not None else meta.sharding(), **kw)
        saved = {e.name: e for e in self.model.entries()}
        self._split: dict[str, tuple[FusedLinears, str, int]] = {}  # output name -> (spec, param, linear index)
        self._entries: list[TensorEntry] = []
        consumed = set()
        for spec in meta.fused:
            for param in spec.params():
                fused = f"{spec.module}.{spec.fused}.{param}"
                if fused not in saved:
                    continue
                consumed.add(fused)
                shape = list(saved[fused].shape)
                for i, linear in enumerate(spec.linears):
                    name = f"{spec.module}.{linear}.{param}"
                    shape[spec.axis] = spec.dims[i]
                    self._entries.append(TensorEntry(name, saved[fused].dtype, tuple(shape)))
                    self._split[name] = (spec, param, i)
        self._entries += [saved[n] for n in meta.parameters if n in saved and n not in consumed]
        # consolidation keeps the parameters of its metadata only (buffers are not part of the Transformers weights)
        self.skipped = list(self.model.skipped) + [n for n in saved if n not in meta.parameters]

    def entries(self) -> list[TensorEntry]:
        return list(self._entries)

    def read(self, name: str) -> torch.Tensor:
        if name not in self._split:
            return self.model.read(name)
        spec, param, index = self._split[name]
        fused_name = f"{spec.module}.{spec.fused}.{param}"
        merged = self.model.read(fused_name)
        tp = self.model.tp
        dim = self.model.sharding_of(fused_name).partition_dim if tp > 1 else spec.axis
        if dim is None:
            raise ExportNotSupportedError(f"{fused_name} is fused and replicated over TP ranks; cannot unfuse it")
        locals_ = merged.chunk(tp, dim=dim) if tp > 1 else (merged,)
        parts = [torch.split(local, [d // tp for d in spec.dims], dim=spec.axis)[index] for local in locals_]
        return torch.cat(parts, dim=dim).contiguous()
