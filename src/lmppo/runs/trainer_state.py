"""The trainer's whole state in a checkpoint, and back: trained weights, optimizer, schedule, KL controller,
score normalisation, data position and every rank's RNG, so a resumed run continues exactly. Also the
save itself (:func:`save_trainer_checkpoint`), with the barriers a sharded checkpoint needs.

Tensors travel as named groups (``policy``, ``value``, ``optimizer``, ``rng``) for
:func:`lmppo.runs.checkpoint.save_checkpoint`; the rest is JSON. No pickle anywhere.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from lmppo.errors import LmppoError, warn
from lmppo.inputs.config import Config
from lmppo.modeling.distributed import (
    barrier,
    from_local_like,
    full_tensor,
    gather_objects,
    local_part,
    rank_seed,
    seed_everything,
    shard_like,
    whole_group,
)
from lmppo.runs.build import build_kl_controller
from lmppo.runs.checkpoint import (
    CHECKPOINTS_DIR,
    capture_rng_state,
    flatten_state,
    restore_rng_state,
    save_checkpoint,
    shard_scratch_dir,
    unflatten_state,
    write_tensor_groups,
)
from lmppo.sampling.rollout import EpisodePart, Rollout, concat_rollouts, trim_padding
from lmppo.training.base import Trainer

TensorGroups = dict[str, dict[str, torch.Tensor]]


def trained_modules(trainer: Trainer) -> dict[str, tuple[nn.Module, set[int]]]:
    """name -> (module, ids of parameters saved under another name: the shared trunk); no critic, no
    ``value`` group."""
    modules = {"policy": (trainer.policy, set())}
    if trainer.value_model is not None:
        modules["value"] = (trainer.value_model, {id(p) for p in trainer.policy.parameters()})
    return modules


def state_payload(trainer: Trainer) -> tuple[TensorGroups, dict]:
    """``(tensors, state)`` for :func:`lmppo.runs.checkpoint.save_checkpoint`.

    Under FSDP2 every sharded weight and optimizer state is gathered whole (one all-gather per tensor,
    in the same order on every rank), so the checkpoint is the same as one process's and resumes on any
    number of ranks and either strategy. Only rank 0, which writes, keeps the tensors: the others return
    empty groups. With ``distributed.checkpoint=sharded`` each rank returns its own shards instead, as
    groups ``<group>-rank<r>`` that it writes itself. A collective: every rank calls it.
    """
    if trainer.spec.sharded_checkpoints:
        suffix, collect = f"-rank{trainer.rank}", lambda group: {k: local_part(v) for k, v in group.items()}
    else:
        suffix, collect = "", lambda group: _whole(group, trainer.rank)
    tensors = {
        f"{name}{suffix}": collect(
            {k: p.detach() for k, p in module.named_parameters() if p.requires_grad and id(p) not in skip}
        )
        for name, (module, skip) in trained_modules(trainer).items()
    }
    optimizer_tensors, optimizer_skeleton = flatten_state(trainer.optimizer.state_dict())
    tensors[f"optimizer{suffix}"] = collect(optimizer_tensors)
    # Every rank's generators (each samples and shuffles its own stream); the rest is the same everywhere
    rng_json, rng_tensors = capture_rng_state()
    per_rank = gather_objects(
        (rng_json, {**rng_tensors, "shuffle": trainer.shuffle_generator.get_state()}), trainer.group
    )
    tensors["rng"] = {f"rank{r}/{k}": v for r, (_, t) in enumerate(per_rank) for k, v in t.items()}
    state = {
        "step": trainer.step_count,
        "policy_version": trainer.policy_version,
        "episodes": trainer.episodes,
        "tokens": trainer.tokens,
        "prompt_stream": trainer.sampler.prompt_stream.state_dict(),
        "kl_controller": trainer.kl_controller.state_dict(),
        "score_transform": trainer.scorer.reward.state_dict(),
        "scheduler": trainer.scheduler.state_dict(),
        "optimizer": optimizer_skeleton,
        "rng": [j for j, _ in per_rank],  # one entry per rank
        "sharded_ranks": trainer.world_size if trainer.spec.sharded_checkpoints else None,
        "token_budgets": trainer.budgets.state_dict(),  # as out-of-memory errors have halved them
    }
    ahead = trainer.sampler.ahead
    if ahead is not None:  # rollout.asynchronous: the batch in flight, sampled by older weights
        in_flight = ahead.finished()
        pending = gather_objects(None if in_flight is None else in_flight.to("cpu"), trainer.group)
        if all(part is not None for part in pending):
            tensors["pending_rollout"], state["pending_rollout"] = _rollout_record(concat_rollouts(pending))
    return tensors, state


def _rollout_record(rollout: Rollout) -> tuple[dict[str, torch.Tensor], dict]:
    """A freshly sampled rollout as tensors and JSON (an episode part's under ``episode.``; its counts,
    small and in the environment's order, in the JSON)."""
    fields = {f.name: getattr(rollout, f.name) for f in dataclasses.fields(rollout)}
    if (episode := fields.pop("episode")) is not None:
        parts = {f.name: getattr(episode, f.name) for f in dataclasses.fields(episode)}
        parts["counts"] = {name: count.tolist() for name, count in episode.counts.items()}
        fields |= {f"episode.{name}": value for name, value in parts.items()}
    tensors = {name: v.cpu() for name, v in fields.items() if isinstance(v, torch.Tensor)}
    return tensors, {name: v for name, v in fields.items() if v is not None and name not in tensors}


def _saved_rollout(tensors: dict[str, torch.Tensor], state: dict) -> Rollout:
    """The rollout :func:`_rollout_record` saved."""
    fields = {**tensors, **state}
    episode = {k.removeprefix("episode."): fields.pop(k) for k in list(fields) if k.startswith("episode.")}
    if episode:
        episode["counts"] = {name: torch.tensor(count) for name, count in episode["counts"].items()}
        fields["episode"] = EpisodePart(**episode)
    return Rollout(**fields)


def _restore_pending_rollout(trainer: Trainer, tensors: TensorGroups, state: dict) -> None:
    """The batch that was in flight at the checkpoint, every rank taking its own rows (the world size may
    have changed: rows are in the prompt stream's global order), for the next step to train on."""
    ahead = trainer.sampler.ahead
    if ahead is None or state.get("pending_rollout") is None:
        return  # synchronous now, or nothing in flight: the next step samples afresh
    saved = _saved_rollout(dict(tensors["pending_rollout"].items()), state["pending_rollout"])
    per_rank = len(saved) // trainer.world_size
    mine = saved.select(slice(trainer.rank * per_rank, (trainer.rank + 1) * per_rank))
    ahead.put(trim_padding(mine).to(trainer.device))


def _whole(tensors: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """``tensors`` whole, gathered one at a time from their shards (every rank takes part), on rank 0;
    empty elsewhere, so no other rank holds a second copy of the trained state."""
    whole = {}
    for name, tensor in tensors.items():
        gathered = full_tensor(tensor)
        if rank == 0:
            whole[name] = gathered
    return whole


def load_state_payload(trainer: Trainer, tensors: TensorGroups, state: dict) -> None:
    """Restore what :func:`state_payload` saved (from any world size and either strategy)."""
    saved, place = _saved_groups(trainer, tensors, state)
    for name, (module, skip) in trained_modules(trainer).items():
        expected = {k: p for k, p in module.named_parameters() if p.requires_grad and id(p) not in skip}
        if set(expected) != set(saved[name]):
            raise LmppoError(
                f"checkpoint's {name} weights do not match this model ({len(saved[name])} saved tensors, "
                f"{len(expected)} trainable here): was it written by a run with other models or LoRA settings?"
            )
        with torch.no_grad():
            for key, param in expected.items():
                param.copy_(place(saved[name][key], param))
    optimizer_state = unflatten_state(saved["optimizer"], state["optimizer"])
    trainer.optimizer.load_state_dict(_optimizer_state_like_params(trainer, optimizer_state, place))
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.kl_controller.load_state_dict(state["kl_controller"])
    trainer.scorer.reward.load_state_dict(state["score_transform"])
    trainer.sampler.prompt_stream.load_state_dict(state["prompt_stream"])
    _restore_rank_rng(trainer, tensors["rng"], state["rng"], int(state["step"]))
    trainer.step_count, trainer.policy_version = int(state["step"]), int(state["policy_version"])
    trainer.sync_generator()  # an engine with its own weights gets the restored policy
    _restore_pending_rollout(trainer, tensors, state)
    trainer.episodes, trainer.tokens = int(state["episodes"]), int(state["tokens"])
    if "token_budgets" in state:  # written before lmppo learned them: the config's
        trainer.budgets.load_state_dict(state["token_budgets"])


def _saved_groups(trainer: Trainer, tensors: TensorGroups, state: dict):
    """The checkpoint's trained groups (``policy``, ``value``, ``optimizer``) and how a saved tensor
    takes a parameter's layout: whole tensors are cut into this rank's shard; this rank's own saved
    shards (a sharded checkpoint, same world size) are used as they are; every rank's saved shards
    (another world size) are put together whole first."""
    names = [*trained_modules(trainer), "optimizer"]
    saved_ranks = state.get("sharded_ranks")
    if saved_ranks is None:
        return {name: tensors[name] for name in names}, shard_like
    if saved_ranks == trainer.world_size and trainer.spec.sharded:
        return {name: tensors[f"{name}-rank{trainer.rank}"] for name in names}, from_local_like
    return {name: whole_group(tensors, name, saved_ranks) for name in names}, shard_like


def _optimizer_state_like_params(trainer: Trainer, optimizer_state: dict, place) -> dict:
    """A saved optimizer state with each parameter's moments laid out like that parameter by
    ``place(saved, param)``. Entries are indexed in param-group order."""
    params = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    for index, entry in optimizer_state["state"].items():
        for key, value in entry.items():
            if value.dim() > 0:  # not the step count
                entry[key] = place(value, params[index])
    return optimizer_state


def _restore_rank_rng(trainer: Trainer, tensors: dict, per_rank_json: list[dict], step: int) -> None:
    """This rank's generators from the checkpoint; re-seeded when it was written by another world size."""
    saved_world = len(per_rank_json)
    if saved_world != trainer.world_size:  # check_compatible refused this unless --allow-config-change
        warn(
            f"the checkpoint was written by {saved_world} ranks and this run has {trainer.world_size}: weights, "
            "optimizer, schedule, KL controller and data position carry over, but each rank's sampling "
            "and shuffling generators start afresh, so the run does not continue bit for bit"
        )
        seed = rank_seed(trainer.cfg.run.seed + step, trainer.rank)  # not the streams the run started with
        seed_everything(seed)
        trainer.shuffle_generator.manual_seed(seed + 1)
        return
    prefix = f"rank{trainer.rank}/"
    rng = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
    trainer.shuffle_generator.set_state(rng.pop("shuffle"))
    restore_rng_state(per_rank_json[trainer.rank], rng)


def apply_changed_settings(trainer: Trainer, cfg: Config, changed: set[str]) -> None:
    """After a resume with ``--allow-config-change``: the changed settings the checkpoint's state would
    otherwise override (``changed``: dotted config keys) take effect from the next step."""
    ppo = cfg.ppo
    if changed & {"ppo.lr", "ppo.value_lr"}:  # the schedule's base rates; its position is kept
        scheduler = trainer.scheduler
        rates = {"policy": ppo.lr, "value": ppo.value_lr or ppo.lr}
        scheduler.base_lrs = [rates[group["name"]] for group in trainer.optimizer.param_groups]
        for group, base, multiplier in zip(
            trainer.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas
        ):
            group["initial_lr"], group["lr"] = base, base * multiplier(scheduler.last_epoch)
    if changed & {"ppo.weight_decay", "ppo.adam_eps"}:
        for group in trainer.optimizer.param_groups:
            group["weight_decay"], group["eps"] = ppo.weight_decay, ppo.adam_eps
    trainer.budgets.reset(cfg, changed)  # a budget set anew replaces the one the run had learned
    if any(key.startswith("kl.") for key in changed):  # a new coefficient or controller starts afresh
        trainer.kl_controller = build_kl_controller(cfg.kl)


def save_trainer_checkpoint(
    trainer: Trainer,
    run_dir: Path,
    state_extra: dict,
    *,
    manifest: dict,
    tag: str,
    keep_last: int,
    best: bool,
) -> Path | None:
    """Save the trainer's state with ``state_extra`` (guards, best) merged in: called on every rank (the
    RNG states are gathered); rank 0 writes and gets the path, the others None.

    With sharded checkpoints every rank first writes its own shards next to the checkpoint-to-be; rank
    0 then moves them in, hashes them with its own files and commits the whole checkpoint."""
    tensors, state = state_payload(trainer)
    state.update(state_extra)
    is_main, group = trainer.rank == 0, trainer.group
    adopt: list[Path] = []
    if trainer.spec.sharded_checkpoints:
        scratch = shard_scratch_dir(run_dir / CHECKPOINTS_DIR, trainer.step_count)
        if is_main:
            scratch.mkdir(parents=True, exist_ok=True)
        barrier(group)
        if not is_main:
            write_tensor_groups(scratch, tensors)
        barrier(group)  # every rank's shards are on disk
        adopt = sorted(scratch.glob("*-rank*"))
    path = None
    if is_main:
        path = save_checkpoint(
            run_dir / CHECKPOINTS_DIR,
            trainer.step_count,
            tensors=tensors,
            state=state,
            manifest=manifest,
            tag=tag,
            keep_last=keep_last,
            adopt=adopt,
            best=best,
        )
    if trainer.spec.sharded_checkpoints:
        barrier(group)  # no rank writes the next checkpoint's shards before this one is committed
    return path
