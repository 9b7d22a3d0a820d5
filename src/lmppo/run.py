"""A whole PPO run: build it from the config, resume it, step it, guard it, checkpoint it, stop it on a
signal, and export the final policy. :class:`lmppo.trainer.PPOTrainer` is the step; this is the loop.

Under ``torchrun`` every rank runs :func:`train`: data parallel over the process group torchrun describes.
"""

from __future__ import annotations

import os
import random
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import torch
from peft import PeftModel
from torch import nn
from transformers import GenerationConfig

from lmppo.build import PPOModels, load_models, load_policy
from lmppo.checkpoint import (
    CHECKPOINTS_DIR,
    Checkpoint,
    best_checkpoint,
    check_compatible,
    last_good_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    load_intact_checkpoint,
    save_checkpoint,
    shard_scratch_dir,
    write_tensor_groups,
)
from lmppo.config import Config
from lmppo.data import load_demonstrations, load_located_prompts, prompt_slices
from lmppo.diagnose import LiveDiagnosis
from lmppo.distributed import (
    DistInfo,
    any_rank,
    barrier,
    check_strategy,
    distributed_session,
    full_tensor,
    gathered,
    rank_seed,
    seed_everything,
    whole_group,
)
from lmppo.errors import GuardAbort, Interrupted, LmppoError, UserCodeError, warn
from lmppo.evaluate import run_evaluator
from lmppo.guards import Guards, held_out_score
from lmppo.metrics import METRICS_FILE, MetricsLogger, ProgressDisplay, read_metrics, reduce_metrics
from lmppo.models import keep_freed_heap_memory
from lmppo.plan import check_plan
from lmppo.preflight import Preflight, run_preflight, summary_line, write_preflight_json
from lmppo.sft import sft_batch
from lmppo.spec import resolve_device, resolve_precision
from lmppo.trainer import PPOTrainer

Evaluator = Callable[[], dict[str, float]]  # held-out eval/* metrics of the current policy


class StopOnSignal:
    """SIGINT / SIGTERM ask the loop to finish the current step, save and exit cleanly."""

    def __init__(self) -> None:
        self.requested: signal.Signals | None = None
        self._previous: dict = {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:  # a second signal: stop now
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def train(
    cfg: Config,
    *,
    resume: bool = False,
    allow_config_change: bool = False,
    evaluator_factory: Callable[[PPOModels], Evaluator] | None = None,
    force: bool = False,
) -> Path:
    """Run (or resume) PPO as configured; returns the run directory. Raises LmppoError on a guard abort.

    ``evaluator_factory(models)`` gives the held-out evaluation run every ``run.eval_every`` steps (by
    default :func:`lmppo.evaluate.run_evaluator`, when ``data.eval_prompts`` is set); its ``eval/*``
    metrics join that step's record (and the ``reward_without_eval`` guard). Step 0's record is the
    starting policy: its first evaluation and the reward pre-flight (:mod:`lmppo.preflight`). The
    rules of :mod:`lmppo.diagnose` watch every record, and a guard abort (:class:`GuardAbort`) says
    what they found. A run whose memory plan does not fit the device is refused before any model is
    loaded, unless ``force``.
    """
    device = resolve_device(cfg.run.device)
    try:
        with distributed_session(device.type, cfg.distributed.timeout_s) as dist_info:
            return _train(cfg, device, dist_info, resume, allow_config_change, evaluator_factory, force)
    except RuntimeError as err:
        if int(os.environ.get("WORLD_SIZE", "1")) == 1 or not is_lost_rank(err):
            raise
        raise lost_rank_error(err, cfg) from None


def is_lost_rank(err: RuntimeError) -> bool:
    """Whether a collective failed because another rank is gone: its connection closed (gloo), or it
    did not answer within ``distributed.timeout_s`` (gloo's timeout, NCCL's backend errors)."""
    return isinstance(err, torch.distributed.DistError) or "gloo" in str(err)


def lost_rank_error(err: RuntimeError, cfg: Config) -> LmppoError:
    """What the surviving ranks say. torchrun stops them too (SIGTERM) when it sees a worker die; the
    job is ending anyway, so that signal is ignored from here on rather than cut this message short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ["WORLD_SIZE"])
    lost = f"rank {1 - rank}" if world == 2 else f"one of the other {world - 1} ranks"
    run_dir = Path(cfg.run.output_dir)
    reason = str(err).strip().splitlines()[0].split(". ")[0][:300]  # its first sentence
    return LmppoError(
        f"rank {rank} lost {lost}: a collective failed ({reason}). A rank died (torchrun's failure summary "
        f"names it and its exit code; -9 is a kill, often the out-of-memory killer) or did not answer within "
        f"distributed.timeout_s={cfg.distributed.timeout_s:g}. Nothing of the unfinished step was saved: the "
        f"last intact checkpoint is {latest_checkpoint(run_dir) or 'none'}. Continue with `torchrun "
        f"--nproc-per-node {world} -m lmppo ppo --resume {run_dir}`."
    )


def _train(
    cfg: Config,
    device: torch.device,
    dist_info: DistInfo,
    resume: bool,
    allow_config_change: bool,
    evaluator_factory: Callable[[PPOModels], Evaluator] | None,
    force: bool,
) -> Path:
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    if device.type == "cpu":
        keep_freed_heap_memory()  # no page faults on every step's large tensors
    run_dir = Path(cfg.run.output_dir)
    check_strategy(cfg.distributed.strategy, dist_info.world_size)
    checkpoint = _checkpoint_to_resume(run_dir, resume, dist_info)
    barrier(dist_info.group)  # every rank has looked for a checkpoint before rank 0 writes the first one
    plan = check_plan(cfg, force)  # before anything heavy: no OOM an hour in
    seed_everything(cfg.run.seed)  # every rank builds the same models (fresh heads, LoRA adapters)

    models = load_models(cfg, device)
    located_prompts = load_located_prompts(cfg.data.prompts, cfg.data.split)
    prompts = [prompt for _, prompt in located_prompts]
    trainer = PPOTrainer(
        cfg,
        models,
        prompts,
        ptx_batches=ptx_batches(cfg, models.tokenizer, device, dist_info.rank),
        group=dist_info.group,
        rank=dist_info.rank,
        world_size=dist_info.world_size,
    )
    for where, prompt in located_prompts:  # a bad prompt is named by its file and line now, not at some step
        trainer.generator.query_ids(prompt, where)
    evaluator = evaluator_factory(models) if evaluator_factory else None
    if evaluator is None and cfg.data.eval_prompts and cfg.run.eval_every:  # the config's held-out evaluation
        evaluator = run_evaluator(cfg, models, dist_info.rank, dist_info.world_size, dist_info.group)
    if dist_info.world_size > 1:
        seed_everything(rank_seed(cfg.run.seed, dist_info.rank))  # then each rank samples its own responses
    guards = Guards(cfg.guards)
    manifest = {
        "config": cfg.model_dump(mode="json"),
        "identities": models.identities,
        "world_size": dist_info.world_size,
        "memory_plan": {"peak_bytes": plan.peak, "available_bytes": plan.available, "fits": plan.fits},
    }

    best: dict = dict(checkpoint.state.get("best") or {}) if checkpoint else {}  # step, metric, score

    def save(tag: str, is_best: bool = False) -> Path | None:
        """Called on every rank (the RNG states are gathered); rank 0 writes. Returns the path on rank 0.
        ``is_best``: this step has the best held-out score so far (``best`` points at it).

        With sharded checkpoints every rank first writes its own shards next to the checkpoint-to-be;
        rank 0 then moves them in, hashes them with its own files and commits the whole checkpoint."""
        tensors, state = trainer.state_payload()
        state["guards"] = guards.state_dict()
        state["best"] = best or None
        adopt: list[Path] = []
        if trainer.sharded_checkpoints:
            scratch = shard_scratch_dir(run_dir / CHECKPOINTS_DIR, trainer.step_count)
            if dist_info.is_main:
                scratch.mkdir(parents=True, exist_ok=True)
            barrier(dist_info.group)
            if not dist_info.is_main:
                write_tensor_groups(scratch, tensors)
            barrier(dist_info.group)  # every rank's shards are on disk
            adopt = sorted(scratch.glob("*-rank*"))
        path = None
        if dist_info.is_main:
            path = save_checkpoint(
                run_dir / CHECKPOINTS_DIR,
                trainer.step_count,
                tensors=tensors,
                state=state,
                manifest=manifest,
                tag=tag,
                keep_last=cfg.run.keep_last,
                adopt=adopt,
                best=is_best,
            )
        if trainer.sharded_checkpoints:
            barrier(
                dist_info.group
            )  # no rank writes the next checkpoint's shards before this one is committed
        return path

    if checkpoint is not None:
        differences = check_compatible(
            checkpoint.manifest,
            manifest["config"],
            models.identities,
            allow_config_change,
            dist_info.world_size,
        )
        manifest["resumed_with_differences"] = differences
        trainer.load_state_payload(checkpoint.tensors, checkpoint.state)
        trainer.apply_changed_settings({d.split(":", 1)[0].removeprefix("config.") for d in differences})
        guards.load_state_dict(checkpoint.state["guards"])
    elif dist_info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    if dist_info.is_main:  # the settings the run goes on with, for the next plain --resume
        (run_dir / "config.yaml").write_text(cfg.to_yaml())

    def evaluate() -> dict[str, float]:
        """Held-out eval/* metrics of the current policy, global (in its own RNG stream: the
        training draws stay as they were)."""
        with trainer.autocast(), gathered(models.policy, models.reference, *models.reward_models):
            return evaluator()

    def improves_best(metrics: dict[str, float]) -> bool:
        """Whether this step's held-out score (the judge's, else the RM's) beats every earlier one; if so
        it becomes the best. The seeds stop on held-out quality, not on the training reward."""
        score = held_out_score(metrics)
        if score is None or (best and score[1] <= best["score"]):
            return False
        best.update(step=trainer.step_count, metric=score[0], score=score[1])
        return True

    def reward_preflight() -> Preflight:
        """How the reward scores the starting policy's samples (global; its own RNG stream)."""
        slices = prompt_slices(cfg.data.prompts, cfg.data.split, cfg.data.slice_key)
        with trainer.autocast(), gathered(models.policy, *models.reward_models):
            return run_preflight(
                cfg, models.policy, models.tokenizer, models.reward, prompts, slices,
                dist_info.rank, dist_info.world_size, dist_info.group,
            )  # fmt: skip

    evaluating = evaluator is not None and cfg.run.eval_every > 0
    start: dict[str, float] = {}  # step 0: the starting policy, what every later record is read against
    preflight = None
    if checkpoint is None:  # the pre-PPO bundle is the first last-known-good checkpoint
        try:
            start.update(evaluate() if evaluating else {})
            preflight = reward_preflight() if cfg.diagnosis.preflight_batches else None
        except UserCodeError as err:  # nothing was trained or saved yet
            raise UserCodeError(
                f"{err}\n--- the run stopped before step 1, scoring the starting policy's samples (the "
                "reward pre-flight or the first evaluation); nothing was saved: fix the code and start the run again"
            ) from None
        if preflight is not None:
            start.update(preflight.metrics)
            if dist_info.is_main:
                write_preflight_json(run_dir, preflight)
        guards.start(start)
        save("ok", is_best=improves_best(start))

    with (
        StopOnSignal() as stop,  # outermost: a signal during the other exits only sets its flag
        MetricsLogger(
            run_dir,
            cfg.logging.sinks,
            is_main_process=dist_info.is_main,
            run_name=cfg.logging.run_name,
            config=manifest["config"],
            resume_step=trainer.step_count if checkpoint else None,
        ) as logger,
        ProgressDisplay(
            cfg.run.steps, quiet=cfg.logging.quiet, start_step=trainer.step_count, enabled=dist_info.is_main
        ) as progress,
    ):
        earlier = read_metrics(run_dir) if checkpoint and (run_dir / METRICS_FILE).is_file() else []
        live = LiveDiagnosis(cfg.diagnosis, [r for r in earlier if r["step"] <= trainer.step_count])

        def log(step: int, metrics: dict[str, float]) -> None:
            """Record a step and show what the diagnosis rules newly find in the history so far."""
            logger.log(step, metrics)
            for finding in live.add(step, metrics):
                progress.note(
                    f"diagnosis at step {step}: {finding.rule}: {finding.evidence} (cause and fix: "
                    f"`lmppo diagnose {run_dir}`)"
                )

        if preflight is not None:
            progress.note(summary_line(preflight))
        if start:
            log(0, start)
        improved = False
        while trainer.step_count < cfg.run.steps:
            try:
                metrics = trainer.step()
            except UserCodeError as err:  # nothing of the failed step was applied or saved
                raise UserCodeError(
                    f"{err}\n--- the run stopped in step {trainer.step_count + 1}; its last checkpoint, "
                    f"{latest_checkpoint(run_dir)}, is intact: fix the code and continue with "
                    f"`lmppo ppo --resume {run_dir}`"
                ) from None
            if evaluating and trainer.step_count % cfg.run.eval_every == 0:
                metrics.update(evaluate())
            metrics = reduce_metrics(metrics, dist_info.group)
            log(trainer.step_count, metrics)
            progress.update(trainer.step_count, metrics)
            violation = guards.check(trainer.step_count, metrics)
            if violation is not None:  # metrics are global, so every rank finds the same violation
                aborted = save("aborted")
                kept = (
                    export_best(run_dir, best, cfg, device, models.tokenizer)
                    if best and dist_info.is_main
                    else None
                )
                barrier(dist_info.group)  # no rank exits (torchrun then stops the rest) while rank 0 writes
                raise guard_abort(violation, aborted, kept, live.findings(), cfg)
            if any_rank(stop.requested is not None, dist_info.group):  # a signal may reach one rank first
                path = save("interrupted")
                received = stop.requested or signal.SIGTERM  # the rank the signal reached first knows which
                raise Interrupted(
                    f"{received.name}: stopped after step {trainer.step_count} and saved "
                    f"{path or 'the checkpoint'}; continue with `lmppo ppo --resume {run_dir}`",
                    received.value,
                )
            improved = guards.healthy and improves_best(metrics)  # a best step is a last good one too
            every = cfg.run.checkpoint_every
            periodic = every and trainer.step_count % every == 0
            if (improved or periodic) and trainer.step_count < cfg.run.steps:  # the last step saves below
                save("ok" if guards.healthy else "unhealthy", is_best=improved)  # only healthy is last good
    save("ok" if guards.healthy else "unhealthy", is_best=improved)
    policy = whole_policy(cfg, models, device, dist_info.is_main) if trainer.sharded else models.policy
    if dist_info.is_main:
        export_final(run_dir / "final", policy, models.tokenizer, cfg)
        if best and best["step"] != trainer.step_count:  # the held-out best is an earlier policy
            export_best(run_dir, best, cfg, device, models.tokenizer)
    barrier(dist_info.group)  # no rank leaves (and tears the group down) before the final model is written
    return run_dir


def guard_abort(
    violation, aborted: Path | None, kept: Path | None, findings: list, cfg: Config
) -> GuardAbort:
    """What a run stopped by a guard says: the guard's message, the checkpoints it leaves (and ``kept``, the
    exported best policy), and what the diagnosis rules find in its metrics so far."""
    run_dir = Path(cfg.run.output_dir)
    diagnosis = "".join(f"\n- {finding}" for finding in findings) or " no known failure mode."
    best = f"; the policy of the best held-out step is exported to {kept}" if kept else ""
    return GuardAbort(
        f"{violation.message}\nThe state at the abort is in {aborted}; the last known good checkpoint is "
        f"{last_good_checkpoint(run_dir)} (the pre-PPO policy is {cfg.models.policy.path}){best}.\n"
        f"Diagnosis of the metrics so far (`lmppo diagnose {run_dir}`):{diagnosis}",
        run_dir,
    )


def resumed_config(run_dir: Path) -> Path:
    """The resolved config a run directory holds, for ``--resume``; a clear error when there is none."""
    config = Path(run_dir) / "config.yaml"
    if not config.is_file():
        raise LmppoError(
            f"--resume: {run_dir} holds no checkpoint yet (the run stopped before its first one was saved, or "
            "this is not a run directory); start the run again with `lmppo ppo CONFIG`"
        )
    return config


def _checkpoint_to_resume(run_dir: Path, resume: bool, dist_info: DistInfo) -> Checkpoint | None:
    if run_dir.exists() and not run_dir.is_dir():
        raise LmppoError(f"run.output_dir={run_dir} is an existing file; set run.output_dir to a directory")
    if resume:
        checkpoint, damaged = load_intact_checkpoint(
            run_dir, set_aside=dist_info.is_main, rank=dist_info.rank, world_size=dist_info.world_size
        )
        if damaged and dist_info.is_main:
            resumed = (
                f"resuming from {checkpoint.path.name}" if checkpoint else "no intact checkpoint is left"
            )
            warn(
                f"--resume: set aside damaged checkpoint(s) in {run_dir / CHECKPOINTS_DIR} (renamed damaged-*, "
                f"kept for inspection): {'; '.join(damaged)}. The steps after the one resumed from are lost and "
                f"are trained again; {resumed}."
            )
        if checkpoint is None:
            raise LmppoError(
                f"--resume: {run_dir} holds no intact checkpoint to resume; start the run again without --resume "
                "(in another run.output_dir, or after moving this one away)"
            )
        return checkpoint
    latest = latest_checkpoint(run_dir)
    if latest is not None:
        raise LmppoError(
            f"{run_dir} already holds a run (checkpoint {latest.name}); continue it with --resume, or set "
            "run.output_dir to a new directory"
        )
    return None


def ptx_batches(
    cfg: Config, tokenizer, device, rank: int = 0
) -> Callable[[], dict[str, torch.Tensor]] | None:
    """PPO-ptx: an endless, seeded stream of SFT batches from data.ptx_demonstrations."""
    if cfg.data.ptx_demonstrations is None or cfg.ppo.ptx_coef == 0:
        return None
    examples = [{"prompt": p, "response": r} for p, r in load_demonstrations(cfg.data.ptx_demonstrations)]
    rng = random.Random(rank_seed(cfg.run.seed, rank))  # each rank its own demonstrations

    def next_batch() -> dict[str, torch.Tensor]:
        batch = sft_batch(tokenizer, rng.sample(examples, min(cfg.ppo.ptx_batch_size, len(examples))))
        return {k: v.to(device) for k, v in batch.items()}

    return next_batch


def plain_policy(
    cfg: Config, device: torch.device, weights: dict[str, torch.Tensor], source: str
) -> nn.Module:
    """The starting policy built afresh on the CPU with ``weights`` (all of them, or the trained ones)
    loaded over it; ``source`` names where they come from in an error."""
    policy = load_policy(cfg, resolve_precision(cfg.run.precision, device))
    unexpected = policy.load_state_dict(
        {k: v.cpu() for k, v in weights.items()}, strict=False
    ).unexpected_keys
    if unexpected:
        raise LmppoError(f"{source} holds policy weights this model does not have: {unexpected[:3]}")
    return policy


def whole_policy(cfg: Config, models: PPOModels, device: torch.device, is_main: bool) -> nn.Module | None:
    """An FSDP2-sharded policy's weights gathered whole into a plain copy on rank 0's CPU (every rank
    takes part in the gathering; the others get None)."""
    state = {name: full_tensor(tensor) for name, tensor in models.policy.state_dict().items()}
    return plain_policy(cfg, device, state, "the sharded policy") if is_main else None


def checkpointed_policy(cfg: Config, device: torch.device, path: Path) -> nn.Module:
    """A plain copy of the policy with the trained weights the checkpoint at ``path`` holds (whole, or
    put together from a sharded checkpoint's per-rank files), on the CPU."""
    saved = load_checkpoint(path)
    weights = whole_group(saved.tensors, "policy", saved.state.get("sharded_ranks"))
    return plain_policy(cfg, device, weights, f"checkpoint {path}")


def export_best(run_dir: Path, best: dict, cfg: Config, device: torch.device, tokenizer) -> Path:
    """``best/``: the policy of the step with the best held-out score (``best``: its step, metric and
    score), from its checkpoint."""
    policy = checkpointed_policy(cfg, device, best_checkpoint(run_dir))
    held_out = f"the best {best['metric']} on the held-out prompts ({best['score']:.4g})"
    return export_final(run_dir / "best", policy, tokenizer, cfg, f"step {best['step']}: {held_out}")


def reward_summary(cfg: Config) -> str:
    """The reward as the model card states it: each source, its weight and its preprocessing."""
    parts = []
    for c in cfg.reward.sources():
        source = c.model.path if c.model else f"the function {c.function}"
        weight = f"{c.name}: {c.weight:g} x " if cfg.reward.components else ""
        preprocessing = f"missing-EOS penalty {c.missing_eos_penalty}, clip {c.clip}, normalize {c.normalize}"
        parts.append(f"{weight}{source} (preprocessing: {preprocessing})")
    gate = cfg.reward.gate
    gated = f"; rows with {gate.component} below {gate.below:g} get {gate.component} alone" if gate else ""
    return " + ".join(parts) + gated


def export_final(out_dir: Path, policy: nn.Module, tokenizer, cfg: Config, which: str = "") -> Path:
    """The trained policy as a plain transformers directory, with our decoding settings and a model card;
    ``which`` says which of the run's policies it is when not the last (``best/``)."""
    if isinstance(policy, PeftModel):
        policy = policy.merge_and_unload()  # training is over: fold the adapter into the weights
    policy.generation_config = GenerationConfig(
        do_sample=True,
        temperature=cfg.rollout.temperature,
        top_k=cfg.rollout.top_k,
        top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.rollout.max_new_tokens,
        eos_token_id=sorted({*cfg.rollout.stop_token_ids, tokenizer.eos_token_id} - {None}),
        pad_token_id=tokenizer.pad_token_id,
    )
    policy.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    reward = reward_summary(cfg)
    kl = (
        f"adaptive, target {cfg.kl.target} nats, horizon {cfg.kl.horizon}"
        if cfg.kl.adaptive
        else f"fixed beta = {cfg.kl.beta}"
    )
    which = (
        f"- This is the policy after {which}; the run's last policy (if it finished) is in `final/`\n"
        if which
        else ""
    )
    (out_dir / "README.md").write_text(
        f"# PPO policy trained with lmppo\n\n"
        f"- Started from: `{cfg.models.policy.path}` (reference: the starting weights)\n"
        f"{which}"
        f"- Reward: {reward}\n"
        f"- KL: {cfg.kl.estimator} estimator per token in the reward, {kl}\n"
        f"- PPO: {cfg.run.steps} steps of {cfg.rollout.batch_size} prompts, {cfg.ppo.ppo_epochs} epochs, "
        f"clip {cfg.ppo.clip_eps}, gamma {cfg.ppo.gamma}, lambda {cfg.ppo.lam}, lr {cfg.ppo.lr}\n"
        f"- Decoding it was trained with (in generation_config.json): temperature {cfg.rollout.temperature}, "
        f"top_k {cfg.rollout.top_k}, top_p {cfg.rollout.top_p}, max_new_tokens {cfg.rollout.max_new_tokens}\n\n"
        "The evaluated artifact is these weights *with* that decoding and that reward preprocessing.\n"
    )
    return out_dir
