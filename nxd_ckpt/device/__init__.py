"""Host <-> device movement of checkpointed state: the layer below state files (``statefile``), above ``xla``.

- ``backend``: which kind of device a tensor lives on (an XLA device, a native accelerator such as CUDA, the
  host), a native device's streams and events, the memory a device reports free, and the device snapshot budget;
- ``pinned``: page-locked host buffers for native accelerators, kept across saves;
- ``transfer``: device -> host copies made on a background thread in byte-bounded chunks (``DeviceTransfer``);
- ``snapshot``: an async save's copy of the state on the device, taken on the training thread, and its transfer;
- ``load``: load targets on the device, filled through a few reused host buffers while the reader reads.

Nothing here imports ``save/``, ``load/`` or ``statefile``'s callers; they import this.
"""
