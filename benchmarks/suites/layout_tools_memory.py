"""Peak memory of the offline layout tools (export, reshard, import) against the largest tensor's bytes.

Writes a synthetic TP=2 PP=2 tag (plain or xser model files with a sharding record in nxd_ckpt.json, committed
like a save) of ``--layers`` layers, each a fused column-parallel (stride 3) weight, a row-parallel weight and a
replicated norm, plus one larger embedding; then runs each tool in a fresh process (``core.child``) and reports that
process's peak resident memory (``VmHWM``) above its resident memory after the imports, divided by the largest
tensor's bytes. The target is a ratio of about 2 or less: the tools hold one whole tensor and its parts, never a
file. Each tool runs twice: as the ``nxd-ckpt`` commands run it (large blocks mmap-ed,
``tools/malloc_tuning.py``) and as a library call in a process with glibc's default allocator settings.

    python -m benchmarks layout_tools_memory --workdir /tmp/layoutbench --layers 6 --hidden 2048
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import time
from typing import Any

from benchmarks.core.child import in_child
from benchmarks.core.report import Report

TITLE = __doc__.splitlines()[0]
SECTIONS = {"plain": "plain model files", "xser": "xser model files"}


def add_options(parser: argparse.ArgumentParser) -> None:
    """The suite's options."""
    parser.add_argument("--workdir", default="/tmp/nxd_layout_bench")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--keep", action="store_true", help="keep the files afterwards")


def tool_child(case: str, src_dir: str, tag: str, out: str, alloc: str) -> dict[str, float]:
    """In a fresh process: one tool's run, its peak resident memory above the resident memory after the imports."""
    # imported before the baseline: code, not data
    import torch.distributed.checkpoint
    import torch.distributed.checkpoint.default_planner  # noqa: F401

    import nxd_ckpt as nxd
    from benchmarks.core.memory import status_bytes
    from nxd_ckpt.tools import dcp_io, export, importer, memory, model_writer, reshard  # noqa: F401

    if alloc == "cli":  # what the nxd-ckpt commands do in their own process (tools/malloc_tuning.py)
        memory.return_large_blocks_to_the_system()
    base, start = status_bytes("VmRSS:") / 2**20, time.perf_counter()
    if case == "export-safetensors":
        export.export(nxd.open_checkpoint(src_dir, tag), out, max_shard_bytes=1 << 30)
    elif case == "export-dcp":
        export.export(nxd.open_checkpoint(src_dir, tag), out, format="dcp")
    elif case.startswith("reshard-"):
        tp, pp = (int(x) for x in case.split("-")[1:])
        reshard.reshard(nxd.open_checkpoint(src_dir, tag), out, tp=tp, pp=pp)
    elif case == "import-tp2":
        sharding = {"*.qkv.weight": (0, 3), "*.out.weight": 1, "embed.weight": 0, "*": None}
        importer.import_weights(src_dir, out, "imported", tp=2, sharding=sharding)
    peak = status_bytes("VmHWM:") / 2**20
    return {"baseline_mb": base, "peak_mb": peak, "seconds": time.perf_counter() - start}


def _record(hidden: int, layers: int) -> tuple[Any, dict]:
    """The sharding record of the synthetic model, and each tensor's (shape, dim, stride, stage)."""
    from nxd_ckpt.format import sharding as shd

    full: dict[str, tuple[tuple[int, ...], int | None, int, int]] = {"embed.weight": ((4 * hidden, hidden), 0, 1, 0)}
    for i in range(layers):
        stage = 0 if i < layers // 2 else 1
        full[f"layers.{i}.qkv.weight"] = ((3 * hidden, hidden), 0, 3, stage)
        full[f"layers.{i}.out.weight"] = ((hidden, hidden), 1, 1, stage)
        full[f"layers.{i}.norm.weight"] = ((hidden,), None, 1, stage)
    record = shd.ShardingRecord({n: shd.TensorSharding(s, d, st if d is not None else 1, 2 if d is not None else 1, p)
                                 for n, (s, d, st, p) in full.items()})  # fmt: skip
    return record, full


def make_input(root: str, tag: str, layers: int, hidden: int, use_xser: bool) -> tuple[int, int]:
    """Write the TP=2 PP=2 tag; return (total model bytes, largest tensor bytes)."""
    import torch

    from nxd_ckpt import statefile
    from nxd_ckpt.format import layout
    from nxd_ckpt.format import sharding as shd
    from nxd_ckpt.format.metadata import TagMetadata
    from nxd_ckpt.tools import offline_tag

    record, full = _record(hidden, layers)
    storage = offline_tag.begin(root, tag)
    for pp in range(2):
        names = [n for n, (_, _, _, stage) in full.items() if stage == pp]
        for tp in range(2):
            state = {}
            for k, name in enumerate(names):  # every rank's part of the same whole tensor (seeded by name)
                whole = torch.randn(full[name][0], generator=torch.Generator().manual_seed(1000 * pp + k))
                state[name] = shd.split(whole, record.require(name), 2, tp)
                del whole
            statefile.write_state_file(storage, layout.model_file(tag, tp, pp), state, xser_encoding=use_xser)
            del state
    meta = TagMetadata(tag=tag, created_at=time.time(), tp=2, pp=2, dp=1, world_size=4, xser=use_xser,
                       items=("model",), torch_version=torch.__version__, sharding=record)  # fmt: skip
    offline_tag.commit(storage, meta)
    nbytes = [4 * int(torch.Size(record.require(n).local_shape(1)).numel()) for n in full]
    return sum(nbytes), max(nbytes)


def encoding(report: Report, args: argparse.Namespace, enc: str) -> list[dict]:
    """One encoding's input, then every tool under both allocator settings."""
    work = os.path.join(args.workdir, enc)
    shutil.rmtree(work, ignore_errors=True)
    t0 = time.perf_counter()
    src = os.path.join(work, "in")
    total, largest = make_input(src, "step_1", args.layers, args.hidden, enc == "xser")
    report.say(f"[{enc}] input: TP=2 PP=2, {total / 2**20:.0f} MiB of model state, largest tensor "
               f"{largest / 2**20:.0f} MiB (written in {time.perf_counter() - t0:.1f} s)", err=True)  # fmt: skip
    cases = [("export-safetensors", src, "step_1", "hf"), ("export-dcp", src, "step_1", "dcp"),
             ("reshard-1-1", src, "step_1", "tp1"), ("reshard-4-2", src, "step_1", "tp4")]  # fmt: skip
    if enc == "plain":
        cases.append(("import-tp2", os.path.join(work, "hf"), "-", "imported"))
    results = []
    allocators = {"cli": "large blocks mmap-ed (nxd-ckpt)", "default": "glibc default (library call)"}
    for (case, s, tag, out), alloc in [(c, a) for c in cases for a in allocators]:
        shutil.rmtree(os.path.join(work, out), ignore_errors=True)
        subprocess.run(["sync"], check=False)
        kwargs = {"case": case, "src_dir": s, "tag": tag, "out": os.path.join(work, out), "alloc": alloc}
        r = in_child("benchmarks.suites.layout_tools_memory:tool_child", kwargs)
        extra = r["peak_mb"] - r["baseline_mb"]
        results.append({"encoding": enc, "case": case, "allocator": allocators[alloc],
                        "state_mib": round(total / 2**20),
                        "largest_tensor_mib": round(largest / 2**20, 1), "peak_above_baseline_mib": round(extra, 1),
                        "ratio_to_largest": round(extra * 2**20 / largest, 2),
                        "seconds": round(r["seconds"], 2)})  # fmt: skip
        report.say(str(results[-1]), err=True)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return results


def run(args: argparse.Namespace, report: Report) -> int:
    """Each encoding asked for, then the table."""
    results = [r for enc in args.sections or list(SECTIONS) for r in encoding(report, args, enc)]
    report.data["rows"] = results
    keys = ("encoding", "case", "allocator", "state_mib", "largest_tensor_mib", "peak_above_baseline_mib",
            "ratio_to_largest", "seconds")  # fmt: skip
    report.table(["encoding", "tool", "allocator", "state (MiB)", "largest tensor (MiB)", "peak above imports (MiB)",
                  "ratio", "s"], [[r[k] for k in keys] for r in results], align="llll")  # fmt: skip
    return 0
