"""DCP checkpointing on one state, in one run: stock DCP, torch_checkpointing and nxd_ckpt's DCP writer + stager.

    $(bash scripts/setup_env.sh cpu | tail -1) -m benchmarks dcp [--sections cpu,xla,cuda] [--size-gb 1]
        [--device-size-gb N] [--reps 5] [--ranks 2] [--warm] [--json out.json]

Run it from the CPU environment (it has torch_checkpointing, a torchtitan dependency); the xla section runs in a
child process of the XLA environment's interpreter (--xla-python, default ~/.cache/nxd-ckpt/envs/xla/bin/python
when this one has no torch_xla), with PJRT_DEVICE=CPU; the cuda section runs when this torch sees a GPU and is
skipped, with the reason, otherwise. A path an environment lacks is listed as missing, with the reason.

Sections:
  cpu   CPU state on --ranks spawned gloo ranks: a replicated fp32 transformer-like model and each rank's ZeRO-1
        AdamW shard (--size-gb GB in all, default 1), saved as ``{"model": ..., "optim_<rank>": ...}``.
  xla   state on the XLA CPU device, one rank: a model of transformer blocks and its AdamW state made by real
        steps (--device-size-gb, default 0.4 GB). Stock paths that refuse XLA tensors get host copies made by one
        bulk transfer inside the timed call (said in the notes).
  cuda  the same on the GPU (default 10 GB).

Save paths, each into a fresh folder until durable: DCP ``dcp.save`` (``FileSystemWriter(sync_files=True)``);
``dcp.async_save``; ``dcp.async_save`` through one ``DefaultStager`` (pinned memory where CUDA is);
``torch_checkpointing.CheckpointManager`` (async; its folder fsynced after its future, timed, since it does not
fsync); ``dcp.async_save`` with ``nxd_ckpt.dcp.StorageWriter`` and one ``nxd_ckpt.dcp.Stager``; ``dcp.save`` with
the nxd writer. Loads, each into the same live state (cold unless --warm): ``dcp.load`` of DCP's sync save,
``dcp.load`` through ``nxd_ckpt.dcp.StorageReader`` of nxd's async save, torch_checkpointing's load of its own.

First an untimed pass: each path's first two saves under the resident-peak sampler (peak extra host memory),
each load under it too, and every load checked bit-exact. Then --reps repetitions, interleaved: the baseline copy
(cpu: a memcpy of the rank's state into a touched buffer; device: the device -> host copy floor) and every save,
then every load, in an order rotated each repetition. Figures are the slowest rank's, medians over repetitions;
the ratios: device state blocked <= 0.1x DCP's async_save + DefaultStager, CPU state blocked <= 1.0x the memcpy,
durable <= 1.1x DCP's sync save, dcp.load's time >= 1.2x the nxd reader's.
"""

from __future__ import annotations

import argparse

from benchmarks.core.report import Report

TITLE = __doc__.splitlines()[0]
SECTIONS = {
    "cpu": "CPU state on 2 gloo ranks: stock DCP, torch_checkpointing, nxd writer + stager; loads; memory",
    "xla": "device state on the XLA CPU device (one rank, the XLA environment)",
    "cuda": "device state on the GPU (one rank; skipped without one)",
}


def add_options(parser: argparse.ArgumentParser) -> None:
    """The suite's options."""
    add = parser.add_argument
    add("--size-gb", type=float, default=1.0, help="GB (10^9 bytes) of CPU state in all ranks (cpu section)")
    add("--device-size-gb", type=float, default=None, help="GB of device state (default: 0.4 XLA, 10 CUDA)")
    add("--reps", type=int, default=5, help="interleaved repetitions")
    add("--ranks", type=int, default=2, help="gloo ranks of the cpu section")
    add("--hidden", type=int, default=1024, help="hidden size of the cpu section's synthetic layers")
    add("--warm", action="store_true", help="do not evict the checkpoints from the page cache before loads")
    add("--dir", default=None, help="where checkpoints are written (default: a temp dir)")
    add("--xla-python", default=None, help="the interpreter of the xla section (default: this one when it has "
        "torch_xla, else the XLA environment's)")  # fmt: skip


def run(args: argparse.Namespace, report: Report) -> int:
    """Run the sections asked for and report each."""
    from benchmarks.suites.dcp.sections import run_cpu, run_device
    from benchmarks.suites.dcp.tables import print_section

    for name in args.sections or list(SECTIONS):
        result = run_cpu(args) if name == "cpu" else run_device(name, args)
        report.data[name] = result
        print_section(report, name, result)
    return 0
