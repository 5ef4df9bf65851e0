"""The peers' saves: torch.save (fsynced) and DCP's async_save through one DefaultStager (a new one per save where
reusing it fails; host copies where it refuses device tensors)."""

from __future__ import annotations

import time
from typing import Any

from benchmarks.core.devices import default_stager_options, host_state
from benchmarks.core.files import remove, torch_save_fsynced
from benchmarks.core.report import fmt_bytes
from benchmarks.suites.device.run import RunCore, say
from benchmarks.suites.device.saves import describe_save


class Peers(RunCore):
    """The peers' saves."""

    def save_torch(self, path: str) -> bool:
        """``torch.save`` of both state dicts, fsynced, said; False when it failed."""
        base = self.dev.mem_start()
        try:
            start = time.perf_counter()
            torch_save_fsynced(self.tr.state_dicts(), path, directory=True)
            elapsed = time.perf_counter() - start
        except Exception as e:
            self.failed("torch_save", e)
            return False
        peak = self.dev.mem_peak(base)
        extra = f", extra device memory {fmt_bytes(peak)}" if peak is not None else ""
        self.add("torch_save", {"s": elapsed, "dev_peak": peak}, f"torch.save + fsync: {elapsed:.3f} s{extra}")
        return True

    def dcp_stage(self) -> Any:
        """One DefaultStager for every DCP save (its cached pinned storages are reused), or None when this torch
        has none (then async_save stages with its own default)."""
        if self.dcp_stager is None and not self.dcp_options.get("unavailable"):
            try:
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            except ImportError as e:
                self.dcp_options["unavailable"] = str(e)
                return None
            options = default_stager_options(self.dev.kind == "cuda")
            self.dcp_options = options
            self.dcp_stager = DefaultStager(StagingOptions(**options))
            if not self.dcp_fresh or not self.results.get("dcp_async"):
                say(f"dcp: DefaultStager(StagingOptions({', '.join(f'{k}={v}' for k, v in options.items())}))")
        return self.dcp_stager

    def save_dcp(self, path: str) -> bool:
        """DCP's async_save, blocked and durable, said; False when it failed (after the fallbacks)."""
        import torch.distributed.checkpoint as dcp

        if self.dcp_fresh and self.dcp_stager is not None:  # untimed: unpinning the previous stager's buffers
            self.dcp_stager.close()
            self.dcp_stager = None
        base = self.dev.mem_start()
        stager = None
        try:
            stager = self.dcp_stage()
            writer = dcp.FileSystemWriter(path, thread_count=4, sync_files=True)
            start = time.perf_counter()
            kwargs = {"async_stager": stager} if stager is not None else {}
            state = self.tr.state_dicts()
            if self.dcp_via_host:
                state = host_state(self.dev, state)
            response = dcp.async_save(state, storage_writer=writer, **kwargs)
            blocked = time.perf_counter() - start
            peak_call = self.dev.mem_peak(base)
            upload = getattr(response, "upload_completion", response)
            staging = getattr(response, "staging_completion", None)
            if staging is not None:  # staging in a thread: training may go on only once it is done
                staging.result()
                blocked = time.perf_counter() - start
            upload.result()
            durable = time.perf_counter() - start
        except Exception as e:
            if stager is not None and not self.dcp_fresh and self.results.get("dcp_async"):
                # torch 2.11: the second async_save through one DefaultStager raised KeyError: <class 'type'>
                self.dcp_fresh = f"{type(e).__name__}: {e}".splitlines()[0]
                say(
                    f"{self.where()} dcp async_save through the DefaultStager used before failed ({self.dcp_fresh}); "
                    "from now on every DCP save gets a new DefaultStager (its pinned buffers allocated in the call)"
                )
                remove(path)
                return self.save_dcp(path)
            if self.dev.kind == "xla" and not self.dcp_via_host:
                self.dcp_via_host = f"{type(e).__name__}: {e}".splitlines()[0]
                say(
                    f"{self.where()} dcp async_save of the XLA state failed ({self.dcp_via_host}); from now on it "
                    "gets host copies (one bulk transfer, timed as part of the call), as a DCP user on XLA would do"
                )
                remove(path)
                return self.save_dcp(path)
            self.failed("dcp_async", e)
            return False
        figures = {
            "call_s": blocked,
            "durable_s": durable,
            "dev_peak_call": peak_call,
            "dev_peak": self.dev.mem_peak(base),
        }
        how = " (of host copies)" if self.dcp_via_host else " (new DefaultStager)" if self.dcp_fresh else ""
        self.add("dcp_async", figures, f"dcp async_save{how}: {describe_save(figures)}")
        return True
