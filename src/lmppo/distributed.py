"""torch.distributed plumbing for ``torchrun``: init from its environment, per-rank seeds, DDP wrapping.

A single process (no ``WORLD_SIZE`` in the environment) needs no launcher and no process group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    group: dist.ProcessGroup | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str) -> DistInfo:
    """Join the process group torchrun describes (gloo on CPU, nccl on GPU), or run alone."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return DistInfo()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, dist.group.WORLD)


def rank_seed(seed: int, rank: int) -> int:
    """Each rank samples its own responses: a distinct, reproducible seed per rank."""
    return seed + 1000 * rank

