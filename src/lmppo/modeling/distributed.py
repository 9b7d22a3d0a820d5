"""torch.distributed plumbing for ``torchrun``: init from its environment, seeding (per rank), DDP
wrapping, FSDP2 sharding (units, gathering a model whole, DTensor <-> full tensors), and the few
collectives the trainer needs.

A single process (no ``WORLD_SIZE`` in the environment) needs no launcher and no process group: every
helper here takes ``group=None`` to mean "alone" and then does no communication at all.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import inspect
import os
import random
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

# FSDP2's default collectives, subclassed only to count their bytes (set_custom_all_gather's protocol)
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from lmppo.errors import LmppoError, UserCodeError
from lmppo.inputs.resolve import RoleSpec, RunSpec
from lmppo.modeling.models import decoder_layers
from lmppo.modeling.quantize import on_device


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
def distributed_session(device: str, timeout_s: float = 600.0) -> Iterator[DistInfo]:
    """Join the process group torchrun describes (gloo on CPU, nccl on GPU), or run alone.

    ``timeout_s`` bounds how long a collective waits for the other ranks: a lost rank then ends this
    one with an error instead of a hang. A group this call creates is destroyed on exit, also after an
    error; one that already exists (a test's, a caller's) is used and left alone.
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
        dist.init_process_group(
            "nccl" if device == "cuda" else "gloo", timeout=datetime.timedelta(seconds=timeout_s)
        )
    try:
        yield DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, dist.group.WORLD)
    except BaseException:
        if created and dist.is_initialized():  # no barrier: a lost rank would never reach it
            dist.destroy_process_group()
        raise
    if created and dist.is_initialized():  # a vLLM engine's shutdown destroys it itself
        # every rank done, and the models' pending work freed, before gloo's threads are torn down: a rank
        # that exits while its peer still holds work aborts with "terminate called without an active exception"
        dist.barrier()
        gc.collect()
        dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and CUDA); sampling draws from torch's global generator."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rank_seed(seed: int, rank: int) -> int:
    """Each rank samples its own responses: a distinct, reproducible seed per rank (rank 0 keeps ``seed``)."""
    return seed + 1000 * rank


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


@contextlib.contextmanager
def failing_together(group: dist.ProcessGroup | None) -> Iterator[None]:
    """Every rank runs the block; when it fails on one rank for the user's reason (their reward function
    raised, or scored NaN), every rank raises that error, naming the rank, instead of the others failing
    later in a collective as if that rank were lost. Costs one small gather after the block (nothing
    alone). The block must hold no collective, which a failing rank would leave the others waiting in."""
    failure = None
    try:
        yield
    except LmppoError as err:
        if group is None:
            raise
        failure = (type(err) is UserCodeError, str(err))
    if group is None:
        return
    failures = gather_objects(failure, group)
    if any(failures):  # every rank done with the gather before any tears its group down on the error
        dist.barrier(group=group)
    for rank, failed in enumerate(failures):
        if failed is not None:
            user_code, message = failed
            raise (UserCodeError if user_code else LmppoError)(f"on rank {rank}: {message}")


def barrier(group: dist.ProcessGroup | None) -> None:
    if group is not None:
        dist.barrier(group=group)


# --------------------------------------------------------------------------------------------------
# Data-parallel wrapping
# --------------------------------------------------------------------------------------------------


class CommCounter:
    """Bytes this rank's collectives moved since the last :meth:`take`, by metric name (MiB on take)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group  # the group DDP's hook reduces over
        self.bytes: dict[str, int] = {}

    def add(self, metric: str, tensor: torch.Tensor) -> None:
        self.bytes[metric] = self.bytes.get(metric, 0) + tensor.numel() * tensor.element_size()

    def take(self) -> dict[str, float]:
        taken, self.bytes = self.bytes, {}
        return {metric: count / 2**20 for metric, count in taken.items()}


def _counting_allreduce(state: CommCounter, bucket):  # no annotations: DDP checks them at runtime
    """DDP's default hook (sum, then divide by the world size), counting the bytes it sends.

    ``bucket``: a ``dist.GradBucket``; returns the future of the averaged bucket.
    """
    state.add("perf/allreduce_mb", bucket.buffer())
    return default_hooks.allreduce_hook(state.group, bucket)


def data_parallel(module: nn.Module, group: dist.ProcessGroup) -> tuple[DistributedDataParallel, CommCounter]:
    """``module`` under DDP (rank 0's weights broadcast to every rank now), with a byte counter.

    No ``device_ids``: inputs are already on the module's device. Buffers (rotary tables) are equal on
    every rank and never trained, so they are not re-broadcast before each forward (torch 2.13 renamed
    the option, deprecating the old name; torch 2.11 and 2.12 know only the old one).
    """
    renamed = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    no_sync = {"forward_sync_buffers" if renamed else "broadcast_buffers": False}
    ddp = DistributedDataParallel(module, process_group=group, **no_sync)
    counter = CommCounter(group)
    ddp.register_comm_hook(counter, _counting_allreduce)
    return ddp, counter


# --------------------------------------------------------------------------------------------------
# Fully sharded data parallel (FSDP2, torch's fully_shard)
# --------------------------------------------------------------------------------------------------


class _CountingAllGather(DefaultAllGather):
    """FSDP2's own all-gather, counting the bytes each rank receives (the whole unit, in compute dtype)."""

    def __init__(self, counter: CommCounter) -> None:
        self.counter = counter

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.counter.add("perf/allgather_mb", output_tensor)
        return super().__call__(output_tensor, input_tensor, group, async_op)


class _CountingReduceScatter(DefaultReduceScatter):
    """FSDP2's own reduce-scatter of gradients, counting the bytes each rank sends."""

    def __init__(self, counter: CommCounter) -> None:
        self.counter = counter

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.counter.add("perf/reduce_scatter_mb", input_tensor)
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


def device_mesh(group: dist.ProcessGroup) -> DeviceMesh:
    """The 1-D mesh of ``group``'s ranks that FSDP2 shards over."""
    return DeviceMesh.from_group(group, collective_device(group).type)


def mixed_precision(compute_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    """Weights all-gathered and computed in ``compute_dtype`` (None: their own), gradients reduced in
    fp32 into fp32 shards: the sharded masters and Adam's state never leave fp32."""
    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)


def fully_shard_model(
    module: nn.Module,
    layers: list[nn.Module],
    mesh: DeviceMesh,
    counter: CommCounter,
    *,
    compute_dtype: torch.dtype | None = None,
    fp32_units: tuple[nn.Module, ...] = (),
    root: bool = True,
) -> None:
    """Shard ``module`` in place: one FSDP2 unit per decoder layer in ``layers``, one per module in
    ``fp32_units`` (computed in fp32 whatever ``compute_dtype``: a critic's head), and the rest as the
    root unit (embeddings, final norm, LM head: tied weights stay in one unit). A unit's weights are
    all-gathered just before its forward and freed after it; the root keeps its weights between the
    forward and the backward, which needs them at once. ``root=False`` shards the listed units only
    (a head on a trunk another model already shards)."""
    # Linear heads and slices return views; nothing downstream changes them in place (the equality tests
    # against one process would fail), so FSDP2's warning about in-place ops on views is noise here.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    units = [(layer, compute_dtype, True) for layer in layers]
    units += [(unit, torch.float32, True) for unit in fp32_units]
    if root:
        units.append((module, compute_dtype, False))
    for unit, dtype, reshard in units:
        fully_shard(unit, mesh=mesh, mp_policy=mixed_precision(dtype), reshard_after_forward=reshard)
        unit.set_custom_all_gather(_CountingAllGather(counter))
        unit.set_custom_reduce_scatter(_CountingReduceScatter(counter))
        unit._lmppo_reshard_after_forward = reshard  # what gathered() restores


def shard_models(
    spec: RunSpec,
    group: dist.ProcessGroup,
    policy: nn.Module,
    value: nn.Module | None,
    frozen: list[tuple[RoleSpec, nn.Module]],
) -> CommCounter:
    """FSDP2 (``spec.sharded``): split the run's models over the ranks, in place, one unit per decoder
    layer, before anything else holds their parameters. Trained weights stay fp32 shards and compute in
    the run's precision; the critic's head computes in fp32; a shared trunk is sharded once, with the
    policy; each frozen model (``frozen``: reference and reward models with their roles) is sharded when its
    role says so (``distributed.shard_frozen``) and keeps its dtype."""
    counter, mesh = CommCounter(), device_mesh(group)
    fully_shard_model(policy, decoder_layers(policy), mesh, counter, compute_dtype=spec.compute_dtype)
    if value is not None:
        _shard_critic(spec, mesh, counter, policy, value)
    for role, model in frozen:
        if role.shards > 1:
            fully_shard_model(model, decoder_layers(model), mesh, counter)
    return counter


def _shard_critic(spec: RunSpec, mesh, counter: CommCounter, policy: nn.Module, value: nn.Module) -> None:
    """The critic's units: its own layers, or only its fp32 head on the policy's (already sharded) trunk."""
    fully_shard_model(
        value,
        [] if value.shared_trunk else decoder_layers(value),
        mesh,
        counter,
        compute_dtype=spec.compute_dtype,
        fp32_units=(value.head,),
        root=not value.shared_trunk,
    )
    if value.shared_trunk:  # FSDP2 sets up on the first forward, which must enter through the root:
        with torch.no_grad():  # one token through the policy, before any value pass enters at the trunk
            policy(input_ids=torch.zeros(1, 1, dtype=torch.long, device=spec.device))
        policy.reshard()


@contextlib.contextmanager
def gathered(*modules: nn.Module | None, nested: bool = True) -> Iterator[None]:
    """The FSDP2 units inside ``modules`` (``nested=False``: ``modules`` themselves, not the units inside
    them) held whole on every rank for the block, and models offloaded whole to host memory brought to their
    device (:func:`lmppo.modeling.quantize.on_device`); a no-op for plain modules (and None: no reward model).
    One all-gather per unit on entry and none inside, so the block may run a different number of forwards on
    each rank (generation stops when a rank's responses end); resharded on exit.

    Costs the unsharded weights (in compute dtype) of ``modules`` at once: the rollout and the stored
    passes gather one model at a time. The update instead all-gathers one layer at a time.
    """
    units = {
        id(m): m
        for module in modules
        if module is not None
        for m in (module.modules() if nested else [module])
        if isinstance(m, FSDPModule)
    }
    # FSDP2 reuses its all-gather buffers in the update: they must not be inference tensors
    with torch.inference_mode(False), torch.no_grad():
        for unit in units.values():
            unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()
    try:
        with contextlib.ExitStack() as on_devices:
            for module in modules:
                if module is not None:
                    on_devices.enter_context(on_device(module))
            yield
    finally:
        for unit in units.values():
            unit.reshard()
            unit.set_reshard_after_forward(unit._lmppo_reshard_after_forward, recurse=False)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded DTensor (an all-gather: every rank must call it), else ``tensor``."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` laid out as the DTensor ``like`` (this rank's shard, cut locally, no communication);
    ``full`` itself when ``like`` is a plain tensor."""
    if not isinstance(like, DTensor):
        return full
    full = full.to(device=like.device, dtype=like.dtype)
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (as stored in a sharded checkpoint), else ``tensor``."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def from_local_like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's saved shard ``local`` as a DTensor laid out like ``like`` (no communication);
    ``local`` itself when ``like`` is a plain tensor."""
    if not isinstance(like, DTensor):
        return local
    local = local.to(device=like.device, dtype=like.dtype)
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def join_shards(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Whole tensors from every rank's saved shards: FSDP2 splits each tensor along dim 0 in rank order
    (torch.chunk sizes), so the whole is their concatenation; a 0-dim entry (a step count) is the same on
    every rank."""
    return {
        key: torch.cat([shard[key] for shard in shards]) if first.dim() else first
        for key, first in shards[0].items()
    }


def whole_group(tensors: dict[str, dict[str, torch.Tensor]], name: str, sharded_ranks: int | None):
    """Checkpoint group ``name`` whole: as saved, or put together from a sharded checkpoint's
    ``<name>-rank<r>`` groups written by ``sharded_ranks`` ranks."""
    if not sharded_ranks:
        return tensors[name]
    return join_shards([tensors[f"{name}-rank{r}"] for r in range(sharded_ranks)])


def local_bytes(tensors) -> int:
    """Bytes this rank holds of ``tensors`` (its shards of DTensors; all of a plain tensor)."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors)


def trained_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes this rank holds of what training keeps: the optimizer's parameters, their gradients and its
    state (under FSDP2 their shards, about 1/N of DDP's full copies)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params if p.grad is not None]
    states = [v for state in optimizer.state.values() for v in state.values() if v.dim() > 0]
    return local_bytes(params) + local_bytes(grads) + local_bytes(states)
