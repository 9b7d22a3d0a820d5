"""A whole PPO run: build it from the config, resume it, step it, guard it, checkpoint it, stop it on a
signal, and export the final policy. :class:`lmppo.training.trainer.PPOTrainer` is the step; this is the loop.

Under ``torchrun`` every rank runs :func:`train`: data parallel over the process group torchrun describes.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from lmppo.errors import GuardAbort, Interrupted, LmppoError, console, warn, with_context
from lmppo.inputs.config import Config, load_config
from lmppo.inputs.data import (
    Prompt,
    load_demonstrations,
    load_located_prompts,
    load_prompt_rows,
    prompt_slices,
)
from lmppo.inputs.resolve import (
    RunSpec,
    check_batches,
    resolve,
    resolve_device,
)
from lmppo.modeling.compile import cache_dir
from lmppo.modeling.distributed import (
    DistInfo,
    any_rank,
    barrier,
    distributed_session,
    gathered,
    rank_seed,
    seed_everything,
)
from lmppo.modeling.models import PPOModels, keep_freed_heap_memory
from lmppo.progress import ProgressDisplay, advance, phase
from lmppo.runs.build import build_trainer, load_models, run_tool_schemas
from lmppo.runs.checkpoint import (
    CHECKPOINTS_DIR,
    MANIFEST_FILE,
    Checkpoint,
    RunDirLock,
    check_compatible,
    last_good_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    load_intact_checkpoint,
)
from lmppo.runs.diagnose import LiveDiagnosis
from lmppo.runs.evaluate import run_evaluator
from lmppo.runs.export import export_best, export_critic, export_final, whole_policy
from lmppo.runs.guards import Guards, held_out_score
from lmppo.runs.plan import MemoryPlan, check_plan, remedy_list
from lmppo.runs.preflight import Preflight, run_preflight, summary_line, write_preflight_json
from lmppo.runs.trainer_state import apply_changed_settings, load_state_payload, save_trainer_checkpoint
from lmppo.signals import StopOnSignal, StopRequested
from lmppo.training.budgets import OutOfMemory, out_of_memory_error
from lmppo.training.metrics import METRICS_FILE, MetricsLogger, read_metrics, reduce_metrics
from lmppo.training.sft import sft_batch

Evaluator = Callable[[], dict[str, float]]  # held-out eval/* metrics of the current policy


def train(
    cfg: Config,
    *,
    resume: bool = False,
    allow_config_change: bool = False,
    evaluator_factory: Callable[[PPOModels], Evaluator] | None = None,
    force: bool = False,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> Path:
    """Run (or resume) PPO as configured; returns the run directory. Raises LmppoError on a guard abort.

    ``evaluator_factory(models)`` gives the held-out evaluation run every ``run.eval_every`` steps (by
    default :func:`lmppo.runs.evaluate.run_evaluator`, when ``data.eval_prompts`` is set); its ``eval/*``
    metrics join that step's record (and the ``reward_without_eval`` guard). Step 0's record is the
    starting policy: its first evaluation and the reward pre-flight (:mod:`lmppo.runs.preflight`). The
    rules of :mod:`lmppo.runs.diagnose` watch every record, and a guard abort (:class:`GuardAbort`) says
    what they found. A run whose memory plan does not fit the device is refused before any model is
    loaded, unless ``force``. ``on_step(step, metrics)`` gets each logged record on the main process.
    """
    device = resolve_device(cfg.run.device)
    try:
        with distributed_session(device.type, cfg.distributed.timeout_s) as dist_info:
            return _train(
                cfg, device, dist_info, resume, allow_config_change, evaluator_factory, force, on_step
            )
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
    on_step: Callable[[int, dict[str, float]], None] | None,
) -> Path:
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    spec = resolve(cfg, device=device, world_size=dist_info.world_size)  # every check before anything heavy
    with owning(Path(cfg.run.output_dir), dist_info):
        checkpoint = _checkpoint_to_resume(Path(cfg.run.output_dir), resume, dist_info)
        barrier(dist_info.group)  # every rank has looked for a checkpoint before rank 0 writes the first one
        if checkpoint is not None and finished(checkpoint, cfg):
            if dist_info.is_main:
                console(stderr=True).print(finished_note(cfg), soft_wrap=True, highlight=False)
            return Path(cfg.run.output_dir)
        with (
            StopOnSignal(immediate=True) as stop,  # until step 1 begins, nothing to finish or save
            ProgressDisplay(
                cfg.run.steps,
                quiet=cfg.logging.quiet,
                start_step=checkpoint.step if checkpoint else 0,
                enabled=dist_info.is_main,
                reward_label="rm" if cfg.reward.learned else "reward",
            ) as progress,
        ):
            if checkpoint is None:  # an advisory once per run directory, not at every resume
                progress.note(numerics_line(spec))
            try:
                with phase("checking the memory plan"):
                    plan = check_plan(cfg, spec, force)  # no OOM an hour in
                run = PPORun(cfg, spec, dist_info, plan, evaluator_factory, progress, stop)
                run.on_step = on_step if dist_info.is_main else None
                return run.run_to_end(checkpoint, allow_config_change)
            except StopRequested as stopped:
                raise stopped_at_once(stopped, Path(cfg.run.output_dir)) from None


def stopped_at_once(stopped: StopRequested, run_dir: Path) -> Interrupted:
    """What a signal that could not wait for the end of a step leaves: the last checkpoint, or nothing."""
    latest = latest_checkpoint(run_dir)
    kept = (
        f"the last checkpoint, {latest}, is intact: continue with `lmppo ppo --resume {run_dir}`"
        if latest
        else f"nothing was written to {run_dir}: start the run again"
    )
    return Interrupted(
        f"{stopped.signal.name}: stopped at once, while the run was starting or waiting on its reward "
        f"server; nothing of the step in progress was saved, and {kept}",
        stopped.signal.value,
    )


def finished(checkpoint: Checkpoint, cfg: Config) -> bool:
    """Whether a resumed run has nothing left to do: every step trained and its policy exported."""
    return checkpoint.step >= cfg.run.steps and (Path(cfg.run.output_dir) / "final").is_dir()


def finished_note(cfg: Config) -> str:
    run_dir, steps = cfg.run.output_dir, cfg.run.steps
    return (
        f"{run_dir} has already trained all run.steps={steps} steps (its policy is in {Path(run_dir) / 'final'}); "
        f"nothing to do, nothing written. To train it further, raise run.steps: "
        f"`lmppo ppo --resume {run_dir} run.steps={2 * steps}`"
    )


def numerics_line(spec: RunSpec) -> str:
    """The run's numerics as decided, and why (``run.precision=auto`` depends on the machine)."""
    matmuls = (
        "" if spec.fp32_matmul_precision == "highest" else f", fp32 matmuls {spec.fp32_matmul_precision}"
    )
    return f"precision {spec.precision}{matmuls} on {spec.device.type}: {spec.precision_reason}" + (
        f"; decoder layers compiled for the update and the stored passes (cache: {cache_dir()})"
        if spec.compile
        else ""
    )


@contextlib.contextmanager
def owning(run_dir: Path, dist_info: DistInfo) -> Iterator[None]:
    """The run directory for this run alone (:class:`lmppo.runs.checkpoint.RunDirLock`), held by rank 0 until
    the run ends; every rank stops when it is refused."""
    lock, refusal = None, None
    if dist_info.is_main:
        try:
            lock = RunDirLock(run_dir)
        except LmppoError as err:
            refusal = err
    if any_rank(refusal is not None, dist_info.group):
        raise refusal or LmppoError(f"rank 0 could not take run.output_dir={run_dir}; its message says why")
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


class PPORun:
    """A whole run around the trainer: :meth:`start` (step 0: the first evaluation, the reward
    pre-flight, the first checkpoint), :meth:`after_step` (evaluation cadence, guards, best, checkpoint
    cadence, signals) and :meth:`finish` (the final checkpoint and exports); :meth:`run` is the loop."""

    def __init__(
        self,
        cfg: Config,
        spec: RunSpec,
        dist_info: DistInfo,
        plan: MemoryPlan,
        evaluator_factory: Callable[[PPOModels], Evaluator] | None,
        progress: ProgressDisplay,
        stop: StopOnSignal,
    ) -> None:
        self.cfg, self.spec, self.dist_info, self.plan = cfg, spec, dist_info, plan
        self.progress, self.stop = progress, stop
        self.run_dir, self.resumed = Path(cfg.run.output_dir), False
        self.on_step: Callable[[int, dict[str, float]], None] | None = None  # the Python API's callback
        located_prompts = load_located_prompts(cfg.data.prompts, cfg.data.split, cfg.data.prompt_key)
        self.prompts = [prompt for _, prompt in located_prompts]
        self.prompt_rows = load_prompt_rows(cfg.data.prompts, cfg.data.split)  # what an environment resets on
        check_batches(cfg, len(self.prompts))  # before the minutes of loading models
        seed_everything(cfg.run.seed)  # every rank builds the same models (fresh heads, LoRA adapters)
        self.models = models = load_models(cfg, spec)
        if spec.device.type == "cpu":  # after loading: what loading and quantizing free goes back at once
            keep_freed_heap_memory()  # no page faults on every step's large tensors
        with phase("building the trainer and the rollout engine"):
            self.trainer = build_trainer(
                cfg,
                spec,
                models,
                self.prompts,
                prompt_rows=self.prompt_rows,
                ptx_batches=ptx_batches(cfg, models.tokenizer, spec.device, dist_info.rank),
                group=dist_info.group,
                rank=dist_info.rank,
            )
        self.check_prompts(located_prompts)
        # held-out evaluation and the pre-flight sample as training does: on a vLLM engine when it has one,
        # playing episodes when it has an environment
        self.engine = (
            self.trainer.generator if spec.engine.kind == "vllm" or spec.engine.environment else None
        )
        evaluator = evaluator_factory(models) if evaluator_factory else None
        if (
            evaluator is None and cfg.data.eval_prompts and cfg.run.eval_every
        ):  # the config's held-out evaluation
            evaluator = run_evaluator(
                cfg, models, dist_info.rank, dist_info.world_size, dist_info.group, generator=self.engine
            )
        self.evaluator = evaluator if cfg.run.eval_every > 0 else None
        if dist_info.world_size > 1:
            seed_everything(
                rank_seed(cfg.run.seed, dist_info.rank)
            )  # then each rank samples its own responses
        self.guards = Guards(cfg.guards)
        self.best: dict = {}  # the step with the best held-out score: step, metric, score
        # step 0's record, kept in every checkpoint: a kill between the first checkpoint and the first line
        # of metrics.jsonl would otherwise lose the starting policy's figures for good
        self.start_record: dict[str, float] = {}
        self.manifest = {
            "config": cfg.model_dump(mode="json"),
            "identities": models.identities,
            "world_size": dist_info.world_size,
            "memory_plan": {"peak_bytes": plan.peak, "available_bytes": plan.available, "fits": plan.fits},
        }

    def check_prompts(self, located_prompts: list[tuple[str, Prompt]]) -> None:
        """Every prompt rendered as the policy will see it: a bad one is named by its file and line now,
        not at some step."""
        with phase(f"rendering the {len(located_prompts)} prompts"):
            for i, (where, prompt) in enumerate(located_prompts, start=1):
                self.trainer.generator.renderer.query_ids(prompt, where)
                if i % 100 == 0:
                    advance("prompts", i, len(located_prompts))

    def run_to_end(self, checkpoint: Checkpoint | None, allow_config_change: bool) -> Path:
        """From ``checkpoint`` (None: a new run) to the end; the engine is shut down however it ends."""
        try:
            if checkpoint is not None:
                self.resume(checkpoint, allow_config_change)
            run_dir = self.run()
            barrier(self.dist_info.group)  # every rank done before a vLLM engine's shutdown ends the group
        except BaseException:
            self.trainer.close(abandon=True)  # another rank may be gone: nothing that waits for it
            raise
        self.trainer.close()
        return run_dir

    def resume(self, checkpoint: Checkpoint, allow_config_change: bool) -> None:
        """Continue from ``checkpoint``: the trainer's whole state, the guards', the best step so far and
        step 0's record."""
        differences = check_compatible(
            checkpoint.manifest,
            self.manifest["config"],
            self.models.identities,
            allow_config_change,
            self.dist_info.world_size,
        )
        self.manifest["resumed_with_differences"] = differences
        load_state_payload(self.trainer, checkpoint.tensors, checkpoint.state)
        changed = {d.split(":", 1)[0].removeprefix("config.") for d in differences}
        apply_changed_settings(self.trainer, self.cfg, changed)
        self.guards.load_state_dict(checkpoint.state["guards"])
        self.best = dict(checkpoint.state.get("best") or {})
        self.start_record = checkpoint.state.get("start") or {}  # absent from checkpoints of older lmppo
        self.resumed = True

    def save(self, tag: str, is_best: bool = False) -> Path | None:
        """Every rank calls it; rank 0 writes and gets the path. ``is_best``: this step has the best
        held-out score so far (``best`` points at it)."""
        extra = {"guards": self.guards.state_dict(), "best": self.best or None, "start": self.start_record}
        with phase(f"saving the checkpoint of step {self.trainer.step_count}"):
            return save_trainer_checkpoint(
                self.trainer,
                self.run_dir,
                extra,
                manifest=self.manifest,
                tag=tag,
                keep_last=self.cfg.run.keep_last,
                best=is_best,
            )

    def evaluate(self) -> dict[str, float]:
        """Held-out eval/* metrics of the current policy, global (in its own RNG stream: the training
        draws stay as they were)."""
        models = self.models
        with self.trainer.autocast(), gathered(models.policy, models.reference, *models.reward_models):
            return self.evaluator()

    def improves_best(self, metrics: dict[str, float]) -> bool:
        """Whether this step's held-out score (the judge's, else the RM's) beats every earlier one; if so
        it becomes the best. The seeds stop on held-out quality, not on the training reward."""
        score = held_out_score(metrics)
        if score is None or (self.best and score[1] <= self.best["score"]):
            return False
        self.best.update(step=self.trainer.step_count, metric=score[0], score=score[1])
        return True

    def reward_preflight(self) -> Preflight:
        """How the reward scores the starting policy's samples (global; its own RNG stream)."""
        cfg, models, dist_info = self.cfg, self.models, self.dist_info
        slices = prompt_slices(cfg.data.prompts, cfg.data.split, cfg.data.slice_key)
        with self.trainer.autocast(), gathered(models.policy, *models.reward_models):
            return run_preflight(
                cfg, models.policy, models.tokenizer, models.reward, self.prompts, slices,
                dist_info.rank, dist_info.world_size, dist_info.group, self.engine, self.prompt_rows,
            )  # fmt: skip

    def start(self) -> None:
        """Step 0 of a new run: the starting policy's evaluation and reward pre-flight, what every later
        record is read against, saved as the first last-known-good checkpoint."""
        start: dict[str, float] = {}
        try:
            if self.evaluator:
                with phase("evaluating the starting policy on the held-out prompts"):
                    start.update(self.evaluate())
                self.progress.note(held_out_line(0, start, self.progress.reward_label))
            preflight = None
            if self.cfg.diagnosis.preflight_batches:
                with phase("reward pre-flight: scoring the starting policy's samples"):
                    preflight = self.reward_preflight()
                self.progress.note(summary_line(preflight))
        except (GuardAbort, Interrupted):
            raise
        except LmppoError as err:  # nothing is written before these checks pass
            raise with_context(
                err,
                "the run stopped before step 1, scoring the starting policy's samples (the reward pre-flight "
                f"or the first evaluation); nothing was written to {self.run_dir}: fix it and start the run again",
            ) from None
        if preflight is not None:
            start.update(preflight.metrics)
        if self.dist_info.is_main:
            self.write_config()
            if preflight is not None:
                write_preflight_json(self.run_dir, preflight)
        self.guards.start(start)
        self.start_record = {name: float(value) for name, value in start.items()}  # JSON in the checkpoint
        self.save("ok", is_best=self.improves_best(start))

    def write_config(self) -> None:
        """``config.yaml``: the settings the run goes on with, for the next plain ``--resume``."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(self.cfg.to_yaml())

    def run(self) -> Path:
        """Step 0 (a new run), the PPO steps, the end; returns the run directory."""
        cfg, trainer, is_main = self.cfg, self.trainer, self.dist_info.is_main
        if self.resumed and is_main:
            self.write_config()
        if not self.resumed:
            self.start()
        self.stop.immediate = False  # from here a signal finishes the step and saves it
        with MetricsLogger(
            self.run_dir,
            cfg.logging.sinks,
            is_main_process=is_main,
            run_name=cfg.logging.run_name,
            config=self.manifest["config"],
            resume_step=trainer.step_count if self.resumed else None,
        ) as self.logger:
            earlier = (
                read_metrics(self.run_dir) if self.resumed and (self.run_dir / METRICS_FILE).is_file() else []
            )
            self.live = LiveDiagnosis(cfg.diagnosis, [r for r in earlier if r["step"] <= trainer.step_count])
            # a new run's first record; a resumed run's too when a kill lost it (never twice)
            if self.start_record and not any(r["step"] == 0 for r in earlier):
                self.log(0, self.start_record)
            self.progress.begin_steps(trainer.step_count)
            improved = False
            while trainer.step_count < cfg.run.steps:
                improved = self.after_step(self.step())
        return self.finish(improved)

    def step(self) -> dict[str, float]:
        """One PPO step, its evaluation when due, its metrics reduced over the ranks and logged."""
        trainer = self.trainer
        try:
            with phase(f"step {trainer.step_count + 1}/{self.cfg.run.steps}"):
                metrics = trainer.step()
        except (GuardAbort, Interrupted):
            raise
        except (LmppoError, torch.OutOfMemoryError) as err:  # nothing of the failed step was saved
            raise with_context(
                self.out_of_memory(err) if isinstance(err, torch.OutOfMemoryError | OutOfMemory) else err,
                f"the run stopped in step {trainer.step_count + 1}; nothing of that step was saved and the last "
                f"checkpoint, {latest_checkpoint(self.run_dir)}, is intact: fix it and continue with "
                f"`lmppo ppo --resume {self.run_dir}`",
            ) from None
        evaluated = self.evaluator and trainer.step_count % self.cfg.run.eval_every == 0
        if evaluated:
            with phase(f"evaluating step {trainer.step_count} on the held-out prompts"):
                metrics.update(self.evaluate())
        metrics = reduce_metrics(metrics, self.dist_info.group)
        self.log(trainer.step_count, metrics)
        self.progress.update(trainer.step_count, metrics)
        if evaluated:
            self.progress.note(held_out_line(trainer.step_count, metrics, self.progress.reward_label))
        return metrics

    def out_of_memory(self, err: torch.OutOfMemoryError | OutOfMemory) -> OutOfMemory:
        """An out-of-memory error the step could not recover from, with the memory plan's remedies."""
        if isinstance(err, torch.OutOfMemoryError):  # no phase could redo it: several ranks, or vLLM's
            err = out_of_memory_error(err, self.trainer.budgets, self.trainer.world_size)
        fixes = remedy_list(self.cfg, self.plan)
        return OutOfMemory(f"{err}. " + (f"The memory plan's next remedies: {fixes}" if fixes else ""))

    def write_best(self) -> Path:
        """``best/``: the policy of the step with the best held-out score, from its checkpoint."""
        return export_best(self.run_dir, self.best, self.cfg, self.spec, self.models.tokenizer)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record a step and show what the diagnosis rules newly find in the history so far."""
        self.logger.log(step, metrics)
        if self.on_step is not None and step > 0:  # step 0 is the starting policy, not a PPO step
            self.on_step(step, dict(metrics))
        for finding in self.live.add(step, metrics):
            self.progress.note(
                f"diagnosis at step {step}: {finding.rule}: {finding.evidence} (cause and fix: "
                f"`lmppo diagnose {self.run_dir}`)"
            )

    def after_step(self, metrics: dict[str, float]) -> bool:
        """Guards (abort), signals (stop), the best step and the checkpoint cadence; returns whether this
        step is the best so far."""
        step, group = self.trainer.step_count, self.dist_info.group
        violation = self.guards.check(step, metrics)
        if violation is not None:  # metrics are global, so every rank finds the same violation
            aborted = self.save("aborted")
            kept = self.write_best() if self.best and self.dist_info.is_main else None
            barrier(group)  # no rank exits (torchrun then stops the rest) while rank 0 writes
            raise guard_abort(violation, aborted, kept, self.live.findings(), self.cfg)
        if any_rank(self.stop.requested is not None, group):  # a signal may reach one rank first
            path = self.save("interrupted")
            received = self.stop.requested or signal.SIGTERM  # the rank the signal reached first knows which
            raise Interrupted(
                f"{received.name}: stopped after step {step} and saved {path or 'the checkpoint'}; continue "
                f"with `lmppo ppo --resume {self.run_dir}`",
                received.value,
            )
        improved = self.guards.healthy and self.improves_best(metrics)  # a best step is a last good one too
        every = self.cfg.run.checkpoint_every
        if (
            improved or (every and step % every == 0)
        ) and step < self.cfg.run.steps:  # the last saves in finish
            self.save(
                "ok" if self.guards.healthy else "unhealthy", is_best=improved
            )  # only healthy is last good
        return improved

    def finish(self, improved: bool) -> Path:
        """The last checkpoint, ``final/`` and (when an earlier step was better held out) ``best/``."""
        last = self.save("ok" if self.guards.healthy else "unhealthy", is_best=improved)
        cfg, models, is_main = self.cfg, self.models, self.dist_info.is_main
        policy = whole_policy(cfg, self.spec, models, is_main) if self.spec.sharded else models.policy
        if is_main:
            with phase("exporting the final policy"):
                export_final(self.run_dir / "final", policy, models.tokenizer, cfg, self.spec)
            if self.spec.value is not None:
                with phase("exporting the critic"):
                    export_critic(self.run_dir / "final" / "value", self.spec, load_checkpoint(last))
            if self.best and self.best["step"] != self.trainer.step_count:  # the held-out best is earlier
                self.write_best()
            self.progress.note(finish_note(self.run_dir, self.best, self.trainer.step_count))
        barrier(
            self.dist_info.group
        )  # no rank leaves (and tears the group down) before the final model is written
        return self.run_dir


def held_out_line(step: int, metrics: dict[str, float], reward_label: str) -> str:
    """The held-out scores of one evaluation, for the console."""
    # with episodes the reward is the environment's turn rewards plus the final score (``reward/total``)
    score = "eval/reward/total" if "eval/reward/total" in metrics else "eval/reward/rm_score"
    shown = (
        (score, reward_label),
        ("eval/gold_score", "gold"),
        ("eval/win_rate", "win rate"),
        ("eval/kl/ref", "kl"),
        ("eval/demo_ppl", "demo ppl"),
    )
    values = " · ".join(f"{label} {metrics[name]:.3g}" for name, label in shown if name in metrics)
    return f"held-out at step {step}: {values}"


def finish_note(run_dir: Path, best: dict, last_step: int) -> str:
    """Where a finished run's results are (``best``: its best held-out step, if it evaluated any)."""
    if not best:
        kept = " (set data.eval_prompts to keep the best held-out policy in best/)"
    elif best["step"] == last_step:
        kept = ", the best held-out step too"
    else:
        kept = f"; the best held-out policy (step {best['step']}) is in {run_dir / 'best'}"
    return (
        f"done: the trained policy is in {run_dir / 'final'}{kept}. Next: `lmppo report {run_dir}`, "
        f"`lmppo diagnose {run_dir}`"
    )


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


def resumed_config(run_dir: Path, restore: bool = False) -> Path:
    """The resolved config a run directory holds, for ``--resume``; a clear error when there is none.
    ``restore``: write a missing ``config.yaml`` back from the latest checkpoint's manifest first."""
    config = Path(run_dir) / "config.yaml"
    if config.is_file():
        return config
    latest = latest_checkpoint(run_dir)
    if latest is None:
        raise LmppoError(
            f"--resume: {run_dir} holds no checkpoint yet (the run stopped before its first one was saved, or "
            "this is not a run directory); start the run again with `lmppo ppo CONFIG`"
        )
    if not restore:
        raise LmppoError(
            f"--resume: {config} is missing, but {run_dir} holds checkpoints (the latest: {latest.name}), and each "
            "checkpoint's manifest records the resolved config the run used. Write it back and continue with "
            f"`lmppo ppo --resume {run_dir} --restore-config`, or give the config yourself: "
            f"`lmppo ppo CONFIG --resume {run_dir}`"
        )
    manifest = json.loads((latest / MANIFEST_FILE).read_text())
    config.write_text(load_config(base=manifest["config"]).to_yaml())
    warn(f"restored {config} from the manifest of checkpoint {latest.name}")
    return config


def _checkpoint_to_resume(run_dir: Path, resume: bool, dist_info: DistInfo) -> Checkpoint | None:
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

    rendering = {"chat_template": cfg.models.policy.chat_template, "tools": run_tool_schemas(cfg, tokenizer)}

    def next_batch() -> dict[str, torch.Tensor]:
        chosen = rng.sample(examples, min(cfg.ppo.ptx_batch_size, len(examples)))
        batch = sft_batch(tokenizer, chosen, **rendering)  # rendered as the run's prompts are
        return {k: v.to(device) for k, v in batch.items()}

    return next_batch
