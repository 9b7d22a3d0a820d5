"""torch.distributed plumbing for ``torchrun``: init from its environment, seeding (per rank), DDP
wrapping, and the few collectives the trainer needs.

A single process (no ``WORLD_SIZE`` in the environment) needs no launcher and no process group: every
helper here takes ``group=None`` to mean "alone" and then does no communication at all.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from lmppo.errors import LmppoError


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    group: dist.ProcessGroup | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@contextlib.contextmanager
def distributed_session(device: str) -> Iterator[DistInfo]:
    """Join the process group torchrun describes (gloo on CPU, nccl on GPU), or run alone.

    A group this call creates is destroyed on exit, also after an error; one that already exists (a
    test's, a caller's) is used and left alone.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        yield DistInfo()
        return
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        torch.cuda.set_device(local_rank)  # before the group, so nccl binds this rank to its own GPU
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    try:
        yield DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, dist.group.WORLD)
    finally:
        if created:
            dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and CUDA); sampling draws from torch's global generator."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rank_seed(seed: int, rank: int) -> int:
    """Each rank samples its own responses: a distinct, reproducible seed per rank (rank 0 keeps ``seed``)."""
    return seed + 1000 * rank


def check_world_size(world_size: int, **global_sizes: int | None) -> None:
    """Every global batch size (``name=value``, ``None`` = unset) must split evenly over the ranks."""
    for name, size in global_sizes.items():
        if size is not None and size % world_size:
            raise LmppoError(
                f"{name}={size} is a global size and must be divisible by the {world_size} ranks; "
                f"set it to a multiple of {world_size} or change --nproc-per-node"
            )


# --------------------------------------------------------------------------------------------------
# Collectives (no-ops alone)
# --------------------------------------------------------------------------------------------------


def collective_device(group: dist.ProcessGroup) -> torch.device:
    """Where a collective's tensors must live: the current GPU for nccl, the CPU for gloo."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(group) == "nccl"
        else torch.device("cpu")
    )


def all_sum(values: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Element-wise sum over ranks (a new tensor, on the input's device)."""
    if group is None:
        return values.clone()
    summed = values.detach().to(collective_device(group), copy=True)
    dist.all_reduce(summed, group=group)
    return summed.to(values.device)


def any_rank(flag: bool, group: dist.ProcessGroup | None) -> bool:
    """True on every rank when it is true on any: decisions that must be taken together (stop, save)."""
    return bool(all_sum(torch.tensor([float(flag)]), group).item() > 0)


def gather_objects(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``obj``, indexed by rank, on every rank (picklable objects; in memory only)."""
    if group is None:
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def barrier(group: dist.ProcessGroup | None) -> None:
    if group is not None:
        dist.barrier(group=group)


# --------------------------------------------------------------------------------------------------
# Data-parallel wrapping
# --------------------------------------------------------------------------------------------------


class AllReduceCounter:
    """State of :func:`_counting_allreduce`: bytes of gradient buckets all-reduced since the last read."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.bytes = 0

    def take(self) -> int:
        taken, self.bytes = self.bytes, 0
        return taken


def _counting_allreduce(state: AllReduceCounter, bucket):  # no annotations: DDP checks them at runtime
    """DDP's default hook (sum, then divide by the world size), counting the bytes it sends.

    ``bucket``: a ``dist.GradBucket``; returns the future of the averaged bucket.
    """
    state.bytes += bucket.buffer().numel() * bucket.buffer().element_size()
    return default_hooks.allreduce_hook(state.group, bucket)


def data_parallel(
    module: nn.Module, group: dist.ProcessGroup
) -> tuple[DistributedDataParallel, AllReduceCounter]:
    """``module`` under DDP (rank 0's weights broadcast to every rank now), with a byte counter.

    No ``device_ids``: inputs are already on the module's device. Buffers (rotary tables) are equal on
    every rank and never trained, so they are not re-broadcast before each forward.
    """
    ddp = DistributedDataParallel(module, process_group=group, forward_sync_buffers=False)
    counter = AllReduceCounter(group)
    ddp.register_comm_hook(counter, _counting_allreduce)
    return ddp, counter
