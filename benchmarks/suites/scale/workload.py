"""The scale suite's workload: a Llama-70B-like layout (TP=32, PP=8, DP the rest) and each rank's state of tiny
tensors with the names and count of a 70B stage."""

from __future__ import annotations

from typing import Any

import torch

from nxd_ckpt.ranks.topology import Topology

PUT_RATE, GET_RATE = 3500.0, 5500.0
"""S3 requests per second per partitioned prefix: PUT/COPY/POST/DELETE, and GET/HEAD."""
WRITE_KINDS, READ_KINDS = ("PUT", "POST", "DELETE", "RENAME"), ("GET", "HEAD", "LIST")
RANKS_PER_NODE = 32


def layout_for(n: int) -> tuple[int, int, int]:
    """(TP, PP, DP) of the 70B-like layout at ``n`` ranks: TP=32, PP=8 as far as ``n`` allows, DP the rest."""
    tp = min(32, n)
    pp = min(8, max(1, n // tp))
    return tp, pp, n // (tp * pp)


def stage_state(topo: Topology, layers: int, elems: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The model shard and ZeRO-1 optimizer shard of one rank: a 70B stage's tensor names, ``elems`` each."""
    pp_rank = topo.pp_rank
    per_stage = max(1, layers // topo.pp_size)
    names = []
    if pp_rank == 0:
        names.append("model.embed_tokens.weight")
    for layer in range(pp_rank * per_stage, (pp_rank + 1) * per_stage):
        for part in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names.append(f"model.layers.{layer}.self_attn.{part}.weight")
        for part in ("gate_proj", "up_proj", "down_proj"):
            names.append(f"model.layers.{layer}.mlp.{part}.weight")
        names += [
            f"model.layers.{layer}.input_layernorm.weight",
            f"model.layers.{layer}.post_attention_layernorm.weight",
        ]
    if pp_rank == topo.pp_size - 1:
        names += ["model.norm.weight", "lm_head.weight"]
    sizes = [elems // 2 if name.endswith("norm.weight") else elems * 2 for name in names]
    model = {name: torch.zeros(n) for name, n in zip(names, sizes, strict=True)}
    base = {i: {"exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n)} for i, n in enumerate(sizes)}
    optimizer = {"base_state": base, "shape_info": {i: torch.Size([n * topo.dp_size]) for i, n in enumerate(sizes)}}
    return model, optimizer


def inline_bytes(elems: int) -> int:
    """The xser inline threshold that keeps the (tiny) norm weights inside the reference files and gives every
    matrix a file of its own, as the real sizes do at 70B (norms 16 KiB, matrix shards MiBs; threshold 64 KiB)."""
    return elems * 4
