"""SaveReport: what one save cost and how it ended. The manager builds it; the save pipeline alone fills it in
(the write fields of an async save when its background write ends), its durations read off the save's one clock."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from nxd_ckpt.log import format_bytes, format_rate
from nxd_ckpt.ranks.failures import format_exception


@dataclass
class SaveReport:
    """What one save cost; for async saves the write fields are filled in when the background write ends."""

    tag: str
    checkpoint_dir: str
    async_save: bool
    bytes_written: int = 0
    """Tensor bytes this rank wrote."""
    blocked_s: float = 0.0
    """Time the caller was blocked in ``save``, including ``waited_s``."""
    waited_s: float = 0.0
    """Part of ``blocked_s`` spent waiting for the previous save to finish writing."""
    staging_s: float = 0.0
    """Time to plan and copy the state to host memory."""
    staging_allocated_bytes: int = 0
    """Host staging memory newly allocated by this save (0 when the previous save's buffers were reused); with
    a native accelerator's state, the pinned buffers its transfer thread allocated are added when the write ends."""
    budget_wait_s: float = 0.0
    """Part of ``blocked_s`` an async save under a host memory budget waited for the writer (to free memory, or to
    write what did not fit); 0 without a budget."""
    budget_peak_bytes: int = 0
    """Under a host memory budget: the most bytes of host copies the save held at once (set when the write ends)."""
    budget_copied_by_writers_bytes: int = 0
    """Under a host memory budget: bytes of device copies that writers ahead of the background copies made
    themselves (set when the write ends; docs/async.md)."""
    budget_overdrawn_bytes: int = 0
    """The part of ``budget_copied_by_writers_bytes`` beyond the budget."""
    device_snapshot_bytes: int = 0
    """Bytes of device state copied on the device (async saves): the snapshot's extra device memory at its peak,
    freed chunk by chunk as the copy reaches the host beside training."""
    device_direct_bytes: int = 0
    """Bytes of device state that did not fit the device snapshot budget, moved to the host by the call itself."""
    device_direct_s: float = 0.0
    """Part of ``blocked_s`` spent on ``device_direct_bytes``."""
    device_budget_bytes: int = 0
    """The device snapshot budget this save used: ``device_snapshot_budget`` or ``auto``'s figure, the least any
    rank proposed, kept from save to save until the state's shapes change (docs/async.md)."""
    device_snapshot_fallback: str | None = None
    """Why part of the device snapshot moved by the direct transfer instead: the device ran out of memory in it
    (the save still succeeded, and the budget kept for the next saves shrank); None when it went as planned."""
    ran_pending_step: bool = False
    """The state had a pending XLA graph at the call (a save after the optimizer step, before the step's sync): the
    save ran that graph once, as the step's own sync would, so the tag holds the stepped state (docs/async.md)."""
    write_s: float = 0.0
    """Time to write this rank's files and make them durable."""
    total_s: float = 0.0
    """From the call to the commit outcome (``done`` written, or known on other ranks)."""
    files_written: int = 0
    completed: bool = False
    error: str | None = None
    """Why this save failed, with ``on_save_error="warn"`` (for async saves: once the background write ended)."""
    earlier_failures: list[str] = field(default_factory=list)
    """Background saves that failed since the previous save under ``on_save_error="warn"``."""
    _future: Future | None = field(default=None, repr=False)

    @property
    def throughput_gbps(self) -> float:
        return self.bytes_written / self.write_s / 1e9 if self.write_s > 0 else 0.0

    def summary(self) -> str:
        """One log line: what the save cost."""
        mode = "async" if self.async_save else "sync"
        waited = f" (of which {self.waited_s:.2f} s waiting for the previous save)" if self.waited_s >= 0.001 else ""
        return (
            f"saved {self.tag} ({mode}): {format_bytes(self.bytes_written)} on this rank, training blocked "
            f"{self.blocked_s:.3f} s{waited}, staging {self.staging_s:.3f} s, write {self.write_s:.2f} s "
            f"({format_rate(self.bytes_written, self.write_s)}), durable after {self.total_s:.2f} s"
        )

    def track(self, job: Future) -> None:
        """An async save goes on in ``job`` on the writer thread: ``wait`` blocks on it."""
        self._future = job

    def wait(self) -> SaveReport:
        """Block until this save is durable on this rank (re-raises its error)."""
        if self._future is not None:
            self._future.result()
        return self

    def record_failure(self, error: BaseException) -> str:
        """``on_save_error="warn"``: keep the failure here instead of raising it; returns its description."""
        self.error = format_exception(error)
        return self.error
