"""Devices for the device suites: the few operations a benchmark needs on CUDA and on XLA (``Device``), and
state that lives there: a model of transformer blocks trained by real AdamW steps (``Training``)."""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any

import torch

GIB = 1 << 30


def pick_device(choice: str) -> str:
    """``cuda`` or ``xla``; a clear error (exit 2) when the asked-for device is not available here."""
    if choice in ("auto", "cuda") and torch.cuda.is_available():
        return "cuda"
    if choice == "cuda":
        sys.exit(f"benchmarks: --device cuda, but this torch ({torch.__version__}) sees no CUDA device")
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    try:
        import torch_xla  # noqa: F401
    except ImportError as e:
        what = "no CUDA device and " if choice == "auto" else ""
        sys.exit(
            f"benchmarks: {what}torch_xla cannot be imported in this environment ({sys.executable}: {e}). "
            "Run it in the XLA environment: PJRT_DEVICE=CPU ~/.cache/nxd-ckpt/envs/xla/bin/python "
            "-m benchmarks device (bash scripts/setup_env.sh xla builds it), or on a machine with a GPU."
        )
    return "xla"


class Device:
    """The few device operations the benchmark needs, for CUDA and for XLA."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._pinned: list[torch.Tensor] | None = None
        if kind == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            import torch_xla

            self.xla = torch_xla
            self.device = torch.device(torch_xla.device())

    def name(self) -> str:
        """The device in words, for the report."""
        if self.kind == "cuda":
            return f"{torch.cuda.get_device_name(self.device)} (CUDA {torch.version.cuda})"
        import torch_xla.runtime as xr

        return f"XLA {xr.device_type()} device {self.device} (PJRT_DEVICE={os.environ.get('PJRT_DEVICE')})"

    def versions(self) -> str:
        """torch's version (and torch_xla's)."""
        text = f"torch {torch.__version__}"
        if self.kind == "xla":
            text += f", torch_xla {self.xla.__version__}"
        return text

    def sync(self) -> None:
        """Every pending operation on the device done (XLA: pending graphs executed and waited for)."""
        if self.kind == "cuda":
            torch.cuda.synchronize(self.device)
        else:
            self.xla.sync(wait=True)

    def on_device(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors of ``tensors`` that live on this device."""
        return [t for t in tensors if t.device.type == self.device.type]

    def host_copies(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Private host copies of ``tensors`` (device ones transferred, host ones cloned), in order."""
        device = self.on_device(tensors)
        if self.kind == "xla":
            moved = iter(self.xla._XLAC._xla_get_cpu_tensors(device))
        else:
            moved = iter([t.detach().to("cpu") for t in device])
        return [next(moved) if t.device.type == self.device.type else t.detach().clone() for t in tensors]

    def reference(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """A private copy of ``tensors`` that loads are checked against: on CUDA device clones (compared on the
        device: seconds less per check at 10 GB than host copies), on XLA host copies."""
        if self.kind == "xla":
            return self.host_copies(tensors)
        out = [t.detach().clone() for t in tensors]
        torch.cuda.synchronize(self.device)
        return out

    def readable(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` in a form ``first_difference`` compares with a ``reference``: XLA ones copied to the host."""
        return self.host_copies(tensors) if self.kind == "xla" else tensors

    # floors

    def pinned_copy(self, tensors: list[torch.Tensor]) -> tuple[float, list[torch.Tensor]]:
        """(seconds, host tensors): floor (a). CUDA buffers are pinned, allocated and touched once, reused."""
        device = self.on_device(tensors)
        if self.kind == "xla":
            self.xla._XLAC._xla_sync_multi(device, devices=[], wait=True)  # already materialised: a no-op
            start = time.perf_counter()
            host = self.xla._XLAC._xla_get_cpu_tensors(device)
            return time.perf_counter() - start, host
        if self._pinned is None or [b.shape for b in self._pinned] != [t.shape for t in device]:
            self._pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in device]
            for b in self._pinned:
                b.fill_(0)
        start = time.perf_counter()
        for b, t in zip(self._pinned, device, strict=True):
            b.copy_(t, non_blocking=True)
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - start, self._pinned

    def clone_sync(self, tensors: list[torch.Tensor]) -> float:
        """Floor (b): a device copy of every device tensor, synchronised; the copies are dropped after."""
        device = self.on_device(tensors)
        start = time.perf_counter()
        clones = [t.clone() for t in device]
        if self.kind == "cuda":
            torch.cuda.synchronize(self.device)
        else:
            self.xla._XLAC._xla_sync_multi(clones, devices=[], wait=True, sync_xla_data=False)
        elapsed = time.perf_counter() - start
        del clones
        return elapsed

    def device_time_s(self) -> float | None:
        """Seconds of graph execution so far (XLA's ExecuteTime metric); None on CUDA (timed by the wall there)."""
        if self.kind != "xla":
            return None
        import torch_xla.debug.metrics as met

        data = met.metric_data("ExecuteTime")
        return float(data[1]) / 1e9 if data else 0.0

    def fill(self, left_fraction: float) -> tuple[Any, int]:
        """Take the device's memory until ``left_fraction`` of its size is left (CUDA: device memory; the XLA CPU
        device: this host's, its device memory), touched; (the filler to drop, bytes left free)."""
        if self.kind == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            take = max(0, free - int(left_fraction * total))
            filler = torch.empty(take, dtype=torch.uint8, device=self.device).fill_(1)
            torch.cuda.synchronize(self.device)
            return filler, torch.cuda.mem_get_info(self.device)[0]
        with open("/proc/meminfo") as f:
            meminfo = dict(line.split(":", 1) for line in f)
        total, available = (int(meminfo[k].split()[0]) * 1024 for k in ("MemTotal", "MemAvailable"))
        take = max(0, available - int(left_fraction * total))
        filler = torch.ones(take, dtype=torch.uint8)
        return filler, available - take

    def drop_floor_buffers(self) -> None:
        """Free the pinned buffers of the copy floor."""
        self._pinned = None

    def compiles(self) -> int:
        """Graphs compiled so far (XLA's CompileTime metric; CUDA compiles nothing here)."""
        if self.kind != "xla":
            return 0
        import torch_xla.debug.metrics as met

        data = met.metric_data("CompileTime")
        return int(data[0]) if data else 0

    # memory

    def mem_start(self) -> int | None:
        """Reset the device's peak-memory counter; the bytes allocated now (None where there is no allocator)."""
        if self.kind != "cuda":
            return None
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def mem_peak(self, base: int | None) -> int | None:
        """Peak extra device bytes since ``mem_start`` (None where the device has no allocator figures)."""
        if base is None:
            return None
        return torch.cuda.max_memory_allocated(self.device) - base


# ----------------------------------------------------------------------------------------------- state


class Block(torch.nn.Module):
    """A transformer block: LayerNorms, qkv/proj attention and an fc1/fc2 MLP."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.ln2 = torch.nn.LayerNorm(hidden)
        self.fc1 = torch.nn.Linear(hidden, 4 * hidden)
        self.fc2 = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        attention = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
        x = x + self.proj(attention @ v)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class Model(torch.nn.Module):
    """``layers`` transformer blocks."""

    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Block(hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def layout_for(total_bytes: int, hidden: int | None) -> tuple[int, int]:
    """(hidden, blocks) so that model + 2 AdamW moments come near ``total_bytes`` of fp32."""

    def per_block(h: int) -> int:
        return (12 * h * h + 13 * h) * 4

    model_bytes = total_bytes / 3
    if hidden is None:
        hidden = 256
        for h in (512, 1024, 2048, 4096, 8192):
            if round(model_bytes / per_block(h)) >= 3:
                hidden = h
    return hidden, max(1, round(model_bytes / per_block(hidden)))


class Training:
    """The model, its AdamW optimizer and a fixed input on the device; ``steps`` runs real optimizer steps."""

    def __init__(self, dev: Device, hidden: int, layers: int, seed: int = 0) -> None:
        self.dev = dev
        torch.manual_seed(seed)
        if dev.kind == "cuda":
            with torch.device(dev.device):
                self.model = Model(hidden, layers)
        else:
            self.model = Model(hidden, layers).to(dev.device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(2, 16, hidden, generator=torch.Generator().manual_seed(seed)).to(dev.device)

    def steps(self, n: int) -> None:
        """``n`` optimizer steps, launched back to back, then the device synced."""
        for _ in range(n):
            self.launch_step()
        self.dev.sync()

    def launch_step(self) -> None:
        """One optimizer step, launched and not waited for (XLA: its ``mark_step``), as a training loop runs it."""
        self.trace_step()
        if self.dev.kind == "xla":
            self.dev.xla.sync()

    def trace_step(self) -> None:
        """One optimizer step up to its sync, not included (XLA: the step is a pending graph afterwards)."""
        loss = self.model(self.x).pow(2).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the state, in a fixed order: parameters, then each one's AdamW state."""
        params = list(self.model.parameters())
        out = [p.detach() for p in params]
        for p in params:
            state = self.opt.state[p]
            out += [state[k] for k in sorted(state) if isinstance(state[k], torch.Tensor)]
        return out

    def scribble(self) -> None:
        """Zero every tensor of the state in place (before a checked load: the load must bring every byte back).
        Parameters are written as themselves, as an optimizer does, not through ``detach()`` aliases."""
        with torch.no_grad():
            for p in self.model.parameters():
                p.zero_()
                for t in self.opt.state[p].values():
                    if isinstance(t, torch.Tensor):
                        t.zero_()
        self.dev.sync()

    def state_dicts(self) -> dict[str, Any]:
        """The model's and the optimizer's state dicts, as torch.save and DCP save them."""
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}


def host_state(dev: Device, tree: Any) -> Any:
    """``tree`` (dicts, lists, tuples) with its device tensors replaced by host copies (one bulk transfer on XLA)."""
    found: list[torch.Tensor] = []

    def collect(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                collect(v)
        elif isinstance(x, list | tuple):
            for v in x:
                collect(v)

    collect(tree)
    copies = {id(t): c for t, c in zip(found, dev.host_copies(found), strict=True)}

    def rebuild(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return copies[id(x)] if x.device.type != "cpu" else x
        if isinstance(x, dict):
            return {k: rebuild(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return type(x)(rebuild(v) for v in x)
        return x

    return rebuild(tree)


def nbytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the tensors' data."""
    return sum(t.numel() * t.element_size() for t in tensors)


def first_difference(expected: list[torch.Tensor], actual: list[torch.Tensor]) -> str | None:
    """Where ``actual`` first differs from ``expected`` (count, shape, dtype or values), or None."""
    if len(expected) != len(actual):
        return f"{len(actual)} tensors instead of {len(expected)}"
    for i, (a, b) in enumerate(zip(expected, actual, strict=True)):
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b.to(a.device)):
            return f"tensor {i} ({tuple(a.shape)}, {a.dtype}) differs"
    return None


def default_stager_options(cuda: bool) -> dict[str, bool]:
    """The ``StagingOptions`` this torch's DCP ``DefaultStager`` takes, set as the peers' rows use it: pinned
    memory and non-blocking copies on CUDA only, never shared memory or DCP's own background staging (ImportError
    where this torch has no ``DefaultStager``)."""
    import dataclasses

    from torch.distributed.checkpoint.staging import StagingOptions

    options: dict[str, bool] = {}
    for f in dataclasses.fields(StagingOptions):
        if "pinned" in f.name or "non_blocking" in f.name:
            options[f.name] = cuda
        elif "shared" in f.name or "async_staging" in f.name:
            options[f.name] = False
    return options
