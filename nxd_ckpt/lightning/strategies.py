"""Mixins that ``factory`` puts in front of Lightning's strategy and accelerator classes: checkpoint saves and
removals on every rank (an nxd_ckpt save is collective), and Lightning's XLA strategy under torchrun."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from nxd_ckpt import api, xla
from nxd_ckpt.lightning.checkpoint_io import NxdCheckpointIOBase
from nxd_ckpt.ranks import coordinator


# Mixins without a Lightning base; ``factory`` puts each in front of Lightning's class of the package in use.
class SavesOnEveryRank:
    """Strategy mixin: checkpoint saves and removals run the ``NxdCheckpointIO`` on every rank (Lightning's own
    strategies call it on global rank 0 only; an nxd_ckpt save is collective). With another CheckpointIO the
    strategy behaves as Lightning's."""

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """An ``NxdCheckpointIO`` saves on every rank; any other CheckpointIO as Lightning's strategy has it."""
        io = self.checkpoint_io
        if isinstance(io, NxdCheckpointIOBase):
            io.save_on_every_rank(checkpoint, filepath, storage_options)
        else:
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Lightning's step. After the first one (the optimizer state exists then), an async ``NxdCheckpointIO``
        reserves the host memory of its first save (``prepare_async_save``: faulted in beside training at low
        priority), so that the first save blocks no longer than later ones."""
        out = super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        io = self.checkpoint_io
        if isinstance(io, NxdCheckpointIOBase) and io.async_save and not getattr(self, "_nxd_prepared", False):
            self._nxd_prepared = True
            optimizers = list(self.optimizers)  # type: ignore[attr-defined]
            api.prepare_async_save(
                model=self.lightning_module_state_dict(),  # type: ignore[attr-defined]
                optimizer=self.optimizer_state(optimizers[0]) if len(optimizers) == 1 else None,  # type: ignore[attr-defined]
                use_xser=io.use_xser,
            )
        return out

    def remove_checkpoint(self, filepath: Any) -> None:
        """Every rank tells its CheckpointIO (which keeps the same record of tags on every rank); rank 0 deletes."""
        io = self.checkpoint_io
        if isinstance(io, NxdCheckpointIOBase):
            io.remove_checkpoint(filepath)
        else:
            super().remove_checkpoint(filepath)


class AnyXLADevice:
    """Accelerator mixin: Lightning's XLA accelerator, available wherever torch_xla is (Trainium, XLA on CPU), not
    only on TPUs, without asking a TPU metadata server; one device per process under torchrun."""

    @staticmethod
    def is_available() -> bool:
        """Wherever torch_xla is installed."""
        return xla.available()

    @staticmethod
    def auto_device_count() -> int:
        """One XLA device per process."""
        return 1

    @staticmethod
    def parse_devices(devices: Any) -> int:
        """Lightning's ``devices`` as a count of this process's XLA devices (``"auto"``: 1)."""
        if devices == "auto":
            return 1
        count = len(devices) if isinstance(devices, (list, tuple)) else devices
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ValueError(f"devices must be a positive int (XLA devices of this process), got {devices!r}")
        return count

    @staticmethod
    def get_parallel_devices(devices: Any) -> list:
        """This process's XLA devices."""
        import torch

        return [torch.device("xla", i) for i in range(AnyXLADevice.parse_devices(devices))]


class TorchrunXLA(SavesOnEveryRank):
    """Strategy mixin over Lightning's ``XLAStrategy``: every-rank saves, and processes started by torchrun.

    Under torchrun (``TORCHELASTIC_RUN_ID`` set), as NxDT runs on Trainium, ranks come from torchrun's variables,
    nothing is spawned, and the default process group is used (initialised with the ``xla`` backend if nobody did).
    When that group is not an ``xla`` one (``gloo``: XLA on CPU) the strategy's barrier, broadcast and reduce
    exchange host copies through it, since torch_xla's collectives do not cross processes there; gradients are
    still reduced by torch_xla (``XLAPrecision``). Outside torchrun it is Lightning's ``XLAStrategy`` (xmp.spawn).
    """

    _lightning: ModuleType  # the Lightning package (set by ``factory``)
    _accelerator_class: type

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Lightning's arguments; the accelerator defaults to ``NxdXLAAccelerator``; torchrun is detected here."""
        if not args and kwargs.get("accelerator") is None:
            kwargs["accelerator"] = self._accelerator_class()
        super().__init__(*args, **kwargs)
        environments = importlib.import_module(f"{self._lightning.__name__}.plugins.environments")
        self._torchrun = bool(environments.TorchElasticEnvironment.detect())
        if self._torchrun:
            self.cluster_environment = environments.TorchElasticEnvironment()

    @property
    def checkpoint_io(self) -> Any:
        """An ``NxdCheckpointIO`` as given; otherwise Lightning's (an ``XLACheckpointIO``)."""
        io = self._checkpoint_io
        return io if isinstance(io, NxdCheckpointIOBase) else super().checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        """An ``NxdCheckpointIO`` is taken as is; any other goes through Lightning's check."""
        if isinstance(io, NxdCheckpointIOBase):
            self._checkpoint_io = io
        else:  # Lightning's own check (an XLACheckpointIO)
            self._lightning.strategies.XLAStrategy.checkpoint_io.fset(self, io)

    def _configure_launcher(self) -> None:
        """No launcher under torchrun (it started every process); else Lightning's (xmp.spawn)."""
        if self._torchrun:
            self._launcher = None  # torchrun started every process
        else:
            super()._configure_launcher()

    def set_world_ranks(self) -> None:
        """Ranks from torchrun's variables (as DDP reads them) under torchrun; else Lightning's XLA ranks."""
        if self._torchrun:
            self._lightning.strategies.DDPStrategy.set_world_ranks(self)
        else:
            super().set_world_ranks()

    def setup_distributed(self) -> None:
        """Under torchrun: the default process group (an ``xla`` one if nobody made one); else Lightning's."""
        if not self._torchrun:
            return super().setup_distributed()
        if not coordinator.is_distributed():
            importlib.import_module("torch_xla.distributed.xla_backend")  # registers the "xla" backend
            self._process_group_backend = "xla"
        return self._lightning.strategies.DDPStrategy.setup_distributed(self)

    def _host_collectives(self) -> bool:
        """Whether barrier, broadcast and reduce go through host copies (torchrun over a non-``xla`` group)."""
        return self._torchrun and coordinator.backend() not in (None, "xla")

    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        """Lightning's barrier, over the coordinator when collectives go through host copies."""
        if self._host_collectives():
            api.get_manager().coordinator().barrier(f"Lightning barrier {name or ''}".strip())
        else:
            super().barrier(name, *args, **kwargs)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Lightning's broadcast, of a host copy over the coordinator when collectives go through host copies."""
        if not self._host_collectives():
            return super().broadcast(obj, src)
        device = getattr(obj, "device", None)
        out = api.get_manager().coordinator().broadcast_object(obj.cpu() if device is not None else obj, src=src)
        return out.to(device) if device is not None else out

    def reduce(self, output: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        """Lightning's reduce, through host copies (``_host_reduce``) when collectives go through them."""
        if not self._host_collectives():
            return super().reduce(output, group, reduce_op)
        return _host_reduce(self, output, reduce_op)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Every rank saves, after a step that runs what XLA has pending."""
        xla.mark_step()  # as Lightning's XLA strategy: no rank enters the save with a graph pending
        super().save_checkpoint(checkpoint, filepath, storage_options)


def _host_reduce(strategy: Any, output: Any, reduce_op: Any) -> Any:
    """Sum (or mean) of ``output`` over the ranks through host copies (``NxdXLAStrategy`` under a gloo group)."""
    import torch

    op = str(getattr(reduce_op, "name", reduce_op) or "sum").lower()
    if op not in ("sum", "mean", "avg"):
        raise ValueError(f"NxdXLAStrategy reduces with sum, mean or avg only, got {reduce_op!r}")
    tensor = output if isinstance(output, torch.Tensor) else torch.tensor(output)
    values = api.get_manager().coordinator().all_gather_object(tensor.detach().cpu(), phase="Lightning reduce")
    total = torch.stack(values).sum(dim=0)
    if op in ("mean", "avg"):
        total = total / len(values)
    return total.to(strategy.root_device)
