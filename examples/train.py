"""A small data-parallel training job that checkpoints with nxd_ckpt; run it with torchrun.

    torchrun --standalone --nproc_per_node 2 examples/train.py --ckpt-dir /tmp/ckpt --steps 30

It resumes from the latest complete checkpoint in --ckpt-dir when there is one, saves asynchronously every
--save-every steps, and appends one JSON line per step (step, rank-0 loss) to --loss-log. --crash-at-step K
SIGKILLs every rank right after the save of step K has been handed to the background writer, as a node failure
would, to show that resuming is exact. Data and dropout are seeded per (step, rank), so a resumed run sees the
same batches as an uninterrupted one.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch
import torch.distributed as dist
from torch import nn

import nxd_ckpt as nxd


def build_model(device: torch.device) -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(
        nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)
    ).to(device)


def batch(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 7919 + rank)
    x = torch.randn(64, 32, generator=g)
    y = torch.sin(x[:, :8] * 2.0) + 0.1 * torch.randn(64, 8, generator=g)
    return x.to(device), y.to(device)


def all_reduce_gradients(model: nn.Module, world_size: int) -> None:
    """Average gradients over ranks with gloo on CPU copies (XLA tensors must never reach gloo)."""
    for p in model.parameters():
        if p.grad is None:
            continue
        g = p.grad.detach().cpu()
        dist.all_reduce(g)
        p.grad.copy_((g / world_size).to(p.grad.device))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--keep", type=int, default=3)
    ap.add_argument("--crash-at-step", type=int, default=None)
    ap.add_argument("--loss-log", default=None)
    ap.add_argument("--device", choices=["cpu", "xla"], default="cpu")
    ap.add_argument("--no-xser", action="store_true", help="write plain torch.save files instead of xser")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    xm = None
    if args.device == "xla":
        import torch_xla  # optional: only with --device xla
        import torch_xla.core.xla_model as xm

        device = torch_xla.device()
    else:
        device = torch.device("cpu")

    model = build_model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    start_step = 0
    if nxd.has_checkpoint(args.ckpt_dir):
        content = nxd.load_checkpoint(args.ckpt_dir, model=model, optimizer=opt, scheduler=sched)
        start_step = content["step"]
        if rank == 0:
            print(
                f"[train] resumed from {nxd.latest_checkpoint_tag(args.ckpt_dir)} at step {start_step}",
                flush=True,
            )

    log = open(args.loss_log, "a") if (args.loss_log and rank == 0) else None  # noqa: SIM115
    for step in range(start_step + 1, args.steps + 1):
        torch.manual_seed(step * 31 + rank)  # dropout masks depend only on (step, rank)
        if xm is not None:
            xm.set_rng_state(step * 31 + rank)  # XLA's RNG (dropout on the device) is not torch.manual_seed's
        x, y = batch(step, rank, device)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        all_reduce_gradients(model, world)
        opt.step()
        sched.step()
        if xm is not None:
            torch_xla.sync()  # one graph per step, as every XLA training loop does (else graphs grow and recompile)
        loss_value = float(loss.detach().cpu())
        if log is not None:
            log.write(json.dumps({"step": step, "loss": loss_value}) + "\n")
            log.flush()
        if step % args.save_every == 0:
            report = nxd.save_checkpoint(
                args.ckpt_dir,
                tag=f"step_{step}",
                model=model,
                optimizer=opt,
                scheduler=sched,
                user_content={"step": step},
                use_xser=not args.no_xser,
                async_save=True,
                num_kept_ckpts=args.keep,
            )
            if rank == 0:
                print(f"[train] step {step}: save handed off after {report.blocked_s * 1000:.1f} ms", flush=True)
        if args.crash_at_step is not None and step == args.crash_at_step:
            if rank == 0:
                print(f"[train] step {step}: simulating a node failure (SIGKILL)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    nxd.finalize_checkpoint()
    if log is not None:
        log.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
