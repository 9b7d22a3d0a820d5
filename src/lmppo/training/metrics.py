"""Metric names, their reduction across ranks, and where they go: JSONL always, trackers when asked.

One name per quantity everywhere (trainer, guards, report, docs/metrics.md). ``metrics.jsonl`` holds
one JSON object per logged step, ``{"step": int, "time": unix seconds, **metrics}``; every metric is
a float, and a non-finite one is written as the string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``
(valid JSON that still says which non-finite value it was); :func:`read_metrics` turns them back
into floats.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self

import torch
import torch.distributed as dist

from lmppo.errors import LmppoError
from lmppo.modeling.distributed import collective_device

METRIC_NAMES: dict[str, str] = {
    "reward/rm_score": "mean raw sequence score of the reward model (or reward function), before preprocessing",
    "reward/rm_score_used": "mean score entering the reward after missing-EOS penalty, normalisation, clipping",
    "reward/eos_penalty_frac": "fraction of responses given reward.missing_eos_penalty (they lack EOS)",
    "reward/norm_mean": "running mean of raw scores used by reward.normalize",
    "reward/norm_std": "running standard deviation of raw scores used by reward.normalize",
    "reward/clip_frac": "fraction of scores beyond +-reward.clip before clipping",
    "reward/overlong_penalty": "mean score taken by reward.overlong_buffer's shaping (responses near the limit)",
    "reward/kl_penalty": "mean per-sequence non-score reward, sum_t -beta * KL_t (<= 0 on average); absent "
    "under kl.in_loss",
    "reward/shaped": "mean per-sequence sum of the shaped per-token rewards PPO optimises",
    "kl/ref": "mean per-sequence KL(policy || reference) estimate, summed over response tokens",
    "kl/beta": "KL coefficient used for this step's rewards",
    "policy/loss": "clipped surrogate loss, mean over response tokens and minibatches",
    "policy/clip_frac": "fraction of response tokens whose ratio left [1 - eps, 1 + eps]",
    "policy/approx_kl": "k3 estimate of KL(old || new) per token: how far the update moved the policy",
    "policy/entropy": "mean per-token entropy of the policy's next-token distribution on responses",
    "policy/ratio_mean": "mean importance ratio pi_new / pi_old over response tokens",
    "policy/ratio_std": "standard deviation of the importance ratio over response tokens",
    "policy/ratio_max": "largest importance ratio of any response token",
    "policy/epochs": "PPO epochs run this step (fewer than ppo.ppo_epochs after an approx-KL early stop)",
    "policy/updates": "optimizer updates made this step",
    "policy/frozen": "1 while ppo.critic_warmup_steps trains only the critic (the policy does not move), else 0",
    "policy/grad_norm": "gradient norm of the policy before clipping",
    "policy/kl_loss": "kl.in_loss: k3 estimate of KL(policy || reference) per response token, the loss term",
    "ptx/loss": "per-token SFT loss on data.ptx_demonstrations (PPO-ptx)",
    "sft/loss": "best-of-n: per-token SFT loss on the round's winners, mean over its updates",
    "bon/kept_frac": "best-of-n: share of the round's prompts whose best response was kept (best_of_n.threshold)",
    "bon/winner_score": "best-of-n: mean score (as the reward preprocesses it) of the kept winners",
    "value/loss": "clipped value loss, mean over response tokens and minibatches",
    "value/clip_frac": "fraction of response tokens whose value moved more than the value clip range",
    "value/explained_var": "1 - Var(returns - values) / Var(returns) over response tokens",
    "value/grad_norm": "gradient norm of the critic before clipping",
    "adv/mean": "mean advantage over response tokens, before whitening",
    "adv/std": "standard deviation of the advantages over response tokens, before whitening",
    "adv/flat_group_frac": "group baselines: share of prompts whose samples all scored alike (zero advantage)",
    "rollout/signal_groups": "rollout.dynamic_sampling: groups sampled this step whose samples scored differently",
    "rollout/flat_groups_dropped": "rollout.dynamic_sampling: groups that all scored alike, set aside and replaced",
    "rollout/flat_groups_kept": "rollout.dynamic_sampling: flat groups that filled a batch still short after "
    "the last extra round",
    "rollout/extra_rounds": "rollout.dynamic_sampling: generation rounds beyond the first this step",
    "response/length": "mean number of response tokens (up to and including the first EOS); in an episode, the "
    "policy's own tokens over all its turns",
    "response/eos_frac": "fraction of responses that ended with EOS",
    "response/truncated_frac": "fraction of responses cut off at max_new_tokens",
    "episode/turns": "rollout.environment: mean turns of the policy per episode",
    "episode/tool_calls": "rollout.environment: mean tool calls per episode",
    "episode/tool_failures": "rollout.environment: mean tool calls per episode answered with an error",
    "episode/timeouts": "rollout.environment: share of episodes truncated because an environment call ran past "
    "rollout.environment_timeout_s",
    "episode/context_tokens": "rollout.environment: mean tokens per episode inserted between the policy's turns "
    "(tool output, template glue): in the sequence, never in the loss",
    "reward/turn": "rollout.environment: mean sum per episode of the environment's turn rewards",
    "reward/total": "rollout.environment: mean reward per episode, reward/rm_score + reward/turn (what the "
    "step line, report and eval call the reward)",
    "perf/environment_s": "rollout.environment: seconds the environments took to reset and step (in perf/rollout_s)",
    "health/nonfinite": "number of non-finite values seen in this step's losses, gradients and statistics",
    "health/nonfinite_updates": "updates skipped because a gradient was non-finite",
    "lag/policy_versions": "policy versions between the policy that sampled the rollout and the one updated",
    "lag/rollout_age_s": "seconds between generating the rollout and updating on it",
    "perf/step_s": "wall-clock seconds of the whole PPO step",
    "perf/rollout_s": "seconds the step spent generating (rollout.asynchronous: waiting for the batch sampled during the last update)",
    "perf/generation_s": "seconds the engine sampled this step's batch (rollout.asynchronous: on its worker thread, overlapping the last update; else perf/rollout_s)",
    "perf/score_s": "seconds spent scoring (reward model, reference and value forward passes)",
    "perf/weight_sync_s": "seconds pushing the updated policy into an engine with its own weights (engine=vllm, rollout.asynchronous)",
    "engine/tis_clip_frac": "ppo.tis_cap: share of response tokens whose importance weight hit the cap",
    "engine/logp_gap": "mean |logp_old - trainer log-prob| per response token before the step's first update",
    "perf/reward_s": "of perf/score_s: seconds in the reward (model or function) and its preprocessing",
    "perf/reference_s": "of perf/score_s: seconds in the reference model's forward passes",
    "perf/values_s": "of perf/score_s: seconds in the value model's forward passes (0 when a shared-trunk critic's values come from the decode loop)",
    "perf/update_s": "seconds spent in the PPO epochs",
    "perf/rollout_tokens_per_s": "generated response tokens per second, all ranks",
    "perf/train_tokens_per_s": "response tokens processed per second of PPO update, all ranks",
    "perf/peak_rss_mb": "peak resident memory of the process in MiB",
    "perf/peak_gpu_mb": "peak CUDA memory allocated by torch in MiB (CUDA runs only)",
    "perf/allreduce_mb": "gradient bytes all-reduced by DDP this step, MiB per rank (only with several ranks)",
    "perf/allgather_mb": "FSDP2: weight bytes each rank received by all-gather this step, MiB (fsdp2 only)",
    "perf/reduce_scatter_mb": "FSDP2: gradient bytes each rank sent by reduce-scatter this step, MiB (fsdp2 only)",
    "perf/trained_state_mb": "trained weights + gradients + optimizer state this rank holds, MiB (1/N under fsdp2)",
    "perf/compiles": "compiled runs only: graphs torch.compile built so far in this process (one per grad mode and precision; a count that keeps growing warns)",
    "perf/oom_retries": "phases redone this step after an out-of-memory error, each under half its token budget (run.oom_retries)",
    "perf/generation_batch_tokens": "generation's token budget per decode batch, as out-of-memory errors halved it (logged once halved)",
    "perf/forward_batch_tokens": "the stored passes' token budget per forward, as out-of-memory errors halved it (logged once halved)",
    "perf/micro_batch_tokens": "the update's token budget per micro-batch, as out-of-memory errors halved it (logged once halved)",
    "eval/reward/rm_score": "mean reward-model (or reward function) score on the held-out prompts",
    "eval/reward/total": "rollout.environment: mean reward per held-out episode, its final score plus its turn "
    "rewards",
    "eval/gold_score": "mean gold-judge score on the held-out prompts, where a judge exists",
    "eval/kl/ref": "mean per-sequence KL (k1) of the policy to the reference on held-out samples",
    "eval/demo_ppl": "perplexity of held-out demonstrations under the policy (the alignment tax)",
    "eval/response/length": "mean response length on held-out prompts, EOS included",
    "eval/response/eos_frac": "fraction of held-out responses that ended with a stop token",
    "eval/win_rate": "share of held-out prompts where this policy beats the baseline (gold judge; ties half)",
}

# How a per-rank scalar becomes a global one; every other metric is averaged over ranks.
REDUCE_OPS: dict[str, str] = {
    "policy/ratio_max": "max",
    "health/nonfinite": "max",  # counted over all ranks already: every rank holds the same number
    "health/nonfinite_updates": "max",
    "lag/policy_versions": "max",
    "lag/rollout_age_s": "max",
    "perf/step_s": "max",  # the slowest rank sets the pace
    "perf/rollout_s": "max",
    "perf/generation_s": "max",
    "perf/environment_s": "max",
    "perf/score_s": "max",
    "perf/reward_s": "max",
    "perf/reference_s": "max",
    "perf/values_s": "max",
    "perf/update_s": "max",
    "perf/trained_state_mb": "max",
    "perf/weight_sync_s": "max",
    "perf/rollout_tokens_per_s": "min",  # all ranks' tokens over this rank's seconds: the slowest rank's
    "perf/train_tokens_per_s": "min",
    "perf/peak_rss_mb": "max",
    "perf/peak_gpu_mb": "max",
    "perf/oom_retries": "max",
}

# Old name -> current name: metrics.jsonl files written before a rename still read (read_metrics).
RENAMED_METRICS: dict[str, str] = {
    "health/grad_norm": "policy/grad_norm",
    "lag/engine_logp_gap": "engine/logp_gap",
    "lag/tis_clip_frac": "engine/tis_clip_frac",
    "eval/rm_score": "eval/reward/rm_score",
    "eval/kl_ref": "eval/kl/ref",
    "eval/length": "eval/response/length",
    "eval/eos_frac": "eval/response/eos_frac",
}

METRICS_FILE = "metrics.jsonl"
_JSON_TO_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


@contextmanager
def timed(seconds: dict[str, float], key: str) -> Iterator[None]:
    """Wall seconds of the block, into ``seconds[key]`` (a ``perf/*_s`` metric)."""
    started = time.perf_counter()
    try:
        yield
    finally:
        seconds[key] = time.perf_counter() - started


# --------------------------------------------------------------------------------------------------
# Reduction across ranks
# --------------------------------------------------------------------------------------------------


def reduce_metrics(
    metrics: Mapping[str, float], group: dist.ProcessGroup | None = None, op: str = "mean"
) -> dict[str, float]:
    """Global value of each per-rank scalar: ``REDUCE_OPS[name]`` or ``op`` (mean, sum, max or min).

    Every rank must pass the same keys. One ``all_gather`` of the stacked values serves all ops.
    A mean of per-rank means is exact only when ranks weigh the same (equal shards); statistics that
    need token-weighting across ranks are computed globally in ``core`` (its ``group`` argument).
    """
    names = sorted(metrics)
    values = {name: float(metrics[name]) for name in names}
    if group is None or not names:
        return values
    local = torch.tensor([values[n] for n in names], dtype=torch.float64, device=collective_device(group))
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    per_rank = torch.stack(gathered).cpu()  # (world, n)
    reducers = {
        "mean": lambda c: c.mean(),
        "sum": lambda c: c.sum(),
        "max": lambda c: c.max(),
        "min": lambda c: c.min(),
    }
    return {n: reducers[REDUCE_OPS.get(n, op)](per_rank[:, i]).item() for i, n in enumerate(names)}


# --------------------------------------------------------------------------------------------------
# JSONL and tracker sinks
# --------------------------------------------------------------------------------------------------


def _to_json_number(value: float) -> float | str:
    if math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


def _from_json_number(value: Any) -> Any:
    return _JSON_TO_NONFINITE.get(value, value) if isinstance(value, str) else value


def _import_sink(sink: str):
    """Import a tracker's package (named like the sink), or say which extra to install."""
    try:
        return importlib.import_module(sink)
    except ImportError:
        raise LmppoError(
            f"logging sink {sink!r} needs the {sink} package, which is not installed: "
            "run `pip install 'lmppo[tracking]'` or remove it from logging.sinks"
        ) from None


# A tracker is built as Sink(run_dir, run_name, config, resume_step) and has log(step, metrics) and close().


class _TensorBoardSink:
    def __init__(
        self, run_dir: Path, run_name: str | None, config: dict | None, resume_step: int | None
    ) -> None:
        _import_sink("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        # on resume, drop the events the crashed attempt logged after the checkpoint (as metrics.jsonl does)
        purge_step = None if resume_step is None else resume_step + 1
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge_step)
        if config is not None:
            self.writer.add_text("config", f"```\n{json.dumps(config, indent=2)}\n```")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


TRACKER_RUNS_FILE = "trackers.json"  # in the run directory: each tracker's run id, for --resume


def _tracker_run_id(run_dir: Path, tracker: str) -> str | None:
    path = run_dir / TRACKER_RUNS_FILE
    return json.loads(path.read_text()).get(tracker) if path.is_file() else None


def _keep_tracker_run_id(run_dir: Path, tracker: str, run_id: str) -> None:
    path = run_dir / TRACKER_RUNS_FILE
    ids = json.loads(path.read_text()) if path.is_file() else {}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**ids, tracker: run_id}))
    tmp.replace(path)


class _WandbSink:
    """A resumed run continues its W&B run (its id is kept in ``trackers.json``). Steps the crashed
    attempt logged after the checkpoint are logged again; W&B keeps the first of a step it has seen."""

    def __init__(
        self, run_dir: Path, run_name: str | None, config: dict | None, resume_step: int | None
    ) -> None:
        self.wandb = _import_sink("wandb")
        run_id = _tracker_run_id(run_dir, "wandb") if resume_step is not None else None
        resuming = {"id": run_id, "resume": "must"} if run_id else {}
        self.run = self.wandb.init(
            project="lmppo", name=run_name, config=config, dir=str(run_dir), **resuming
        )
        _keep_tracker_run_id(run_dir, "wandb", self.run.id)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class _MlflowSink:
    """A resumed run continues its MLflow run (its id is kept in ``trackers.json``); a step logged again
    after a crash is a second value at that step."""

    def __init__(
        self, run_dir: Path, run_name: str | None, config: dict | None, resume_step: int | None
    ) -> None:
        self.mlflow = _import_sink("mlflow")
        run_id = _tracker_run_id(run_dir, "mlflow") if resume_step is not None else None
        if run_id:
            run = self.mlflow.start_run(run_id=run_id)
        else:
            run = self.mlflow.start_run(run_name=run_name)
            if config is not None:  # as an artifact: a nested config overflows MLflow's param limits
                self.mlflow.log_dict(config, "config.json")
        _keep_tracker_run_id(run_dir, "mlflow", run.info.run_id)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.mlflow.log_metrics(metrics, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


_TRACKERS = {"tensorboard": _TensorBoardSink, "wandb": _WandbSink, "mlflow": _MlflowSink}


def _parse_lines(path: Path) -> list[dict]:
    """Records of a metrics file; a torn last line (the process died mid-write) is dropped."""
    lines = path.read_text().splitlines(keepends=True)
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines) and not line.endswith("\n"):
                break
            raise LmppoError(f"{path} line {number} is not valid JSON; the metrics file is damaged") from None
    return records


def read_metrics(run_dir: str | Path) -> list[dict]:
    """All records of ``RUN_DIR/metrics.jsonl`` in file order, non-finite strings back as floats and
    metrics logged under an old name (:data:`RENAMED_METRICS`) under their current one."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise LmppoError(f"no metrics at {path}: is {run_dir} a run directory?")
    return [
        {RENAMED_METRICS.get(k, k): _from_json_number(v) for k, v in r.items()} for r in _parse_lines(path)
    ]


def _keep_records_up_to(path: Path, last_step: int | None) -> None:
    """Rewrite ``path`` keeping whole records with ``step <= last_step`` (all whole ones if None).

    A resumed run repeats the steps after its checkpoint; their first attempt must not stay in the
    file next to the second. Rewritten via a temporary file and ``os.replace``.
    """
    if not path.is_file():
        return
    text = path.read_text()
    if last_step is None and (not text or text.endswith("\n")):
        return  # nothing torn, nothing to drop
    records = [r for r in _parse_lines(path) if last_step is None or r["step"] <= last_step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, path)


class MetricsLogger:
    """Writes each step's metrics to ``RUN_DIR/metrics.jsonl`` and the configured trackers.

    Only the main process writes; on the others ``log`` and ``close`` do nothing. ``resume_step``:
    drop records after that step (left by the attempt that crashed after the checkpoint), in the JSONL
    file and in TensorBoard's event files.
    """

    def __init__(
        self,
        run_dir: str | Path,
        sinks: Iterable[str] = ("jsonl",),
        is_main_process: bool = True,
        run_name: str | None = None,
        config: dict | None = None,
        resume_step: int | None = None,
    ) -> None:
        sinks = list(sinks)
        unknown = sorted(set(sinks) - {"jsonl", *_TRACKERS})
        if unknown:
            raise LmppoError(f"unknown logging sink(s) {unknown}; choose from jsonl, {', '.join(_TRACKERS)}")
        self.is_main_process = is_main_process
        self.trackers: list = []
        self._file = None
        if not is_main_process:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / METRICS_FILE
        _keep_records_up_to(self.path, resume_step)
        self.trackers = [
            _TRACKERS[s](run_dir, run_name, config, resume_step) for s in dict.fromkeys(sinks) if s != "jsonl"
        ]
        self._file = self.path.open("a")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if not self.is_main_process:
            return
        if {"step", "time"} & metrics.keys():
            raise ValueError("'step' and 'time' are reserved keys of a metrics record")
        values = {name: float(value) for name, value in metrics.items()}
        record = {
            "step": int(step),
            "time": time.time(),
            **{k: _to_json_number(v) for k, v in values.items()},
        }
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()  # a crash loses at most the step being written
        for tracker in self.trackers:
            tracker.log(step, values)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
