"""The reward pre-flight: before step 1, how the reward scores the starting policy's own samples.

"A scalar reward can carry length, position, and style bias" (the seeds), and PPO finds every one of
them. So before any update a run samples ``diagnosis.preflight_batches`` batches of training prompts
with the training decoding (in its own seeded RNG stream: training's draws stay as they were) and
reads the reward's scores against what should not matter (in an episode, the score plus the environment's
turn rewards: what the run optimises). Logged once, in the step-0 record:

| metric | what |
|---|---|
| ``preflight/rm_score_mean``, ``_std``, ``_p10``, ``_p50``, ``_p90`` | the score distribution |
| ``preflight/total_reward_*`` (the same five), ``preflight/turn_reward_mean`` | episodes: the reward's (score + turn rewards) |
| ``preflight/length_spearman`` | Spearman correlation of the score with the response length |
| ``preflight/eos_corr`` | correlation of the score with ending on EOS (absent when all or none do) |
| ``preflight/eos_frac``, ``preflight/samples`` | share of samples ending on EOS; how many were scored |

The ``reward_bias`` rule of :mod:`lmppo.runs.diagnose` judges the two correlations. ``preflight.json`` (this
module writes it; the report reads it) adds the scores per slice (``data.slice_key``) and the highest
and lowest scored samples (an episode's whole transcript). ``lmppo check-rm CONFIG`` runs the same pre-flight
without training.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.table import Table
from rich.text import Text

from lmppo.inputs.data import Prompt, load_prompt_rows, load_prompts, prompt_slices
from lmppo.inputs.resolve import resolve
from lmppo.modeling.loading import load_tokenizer
from lmppo.modeling.models import autocast
from lmppo.runs.build import generator_options, load_policy, load_reward, policy_generator
from lmppo.runs.diagnose import Finding, reward_bias
from lmppo.runs.evaluate import evaluate_policy, reward_key

PREFLIGHT_FILE = "preflight.json"
N_EXAMPLES = 3  # highest and lowest scored samples kept for reading


@dataclass
class Preflight:
    """``metrics``: the preflight/* values; ``slices``: slice -> {"n", score statistics};
    ``examples``: {"highest", "lowest"} scored samples (prompt, response, rm_score, length, eos; an episode's
    turn_reward, total_reward and transcript too)."""

    metrics: dict[str, float]
    slices: dict[str, dict[str, float]]
    examples: dict[str, list[dict]]

    def to_dict(self) -> dict:
        return asdict(self)


def average_ranks(values: torch.Tensor) -> torch.Tensor:
    """(N,) -> (N,) float64 ranks from 1, tied values sharing the mean of their ranks."""
    values = values.double()
    order = torch.argsort(values, stable=True)
    ranks = torch.empty_like(values)
    ranks[order] = torch.arange(1, len(values) + 1, dtype=torch.float64)
    unique, inverse = torch.unique(values, return_inverse=True)
    sums = torch.zeros(len(unique), dtype=torch.float64).index_add_(0, inverse, ranks)
    counts = torch.zeros(len(unique), dtype=torch.float64).index_add_(0, inverse, torch.ones_like(ranks))
    return (sums / counts)[inverse]


def correlation(x: torch.Tensor, y: torch.Tensor) -> float | None:
    """Pearson correlation of two (N,) tensors; None when either is constant (it is undefined)."""
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    norm = x.norm() * y.norm()
    return None if norm == 0 else (x @ y / norm).item()


def spearman(x: torch.Tensor, y: torch.Tensor) -> float | None:
    """Spearman rank correlation (Pearson on average ranks): a monotone relation, not only a linear one."""
    return correlation(average_ranks(x), average_ranks(y))


def score_statistics(rows: Sequence[dict]) -> dict[str, float]:
    """The preflight/* metrics of scored samples (rows with rm_score, length, eos): the distribution of the
    reward (:func:`reward_key`: an episode's total, its parts' means beside it) and its correlations."""
    key = reward_key(rows)
    scores = torch.tensor([float(row[key]) for row in rows], dtype=torch.float64)
    lengths = torch.tensor([float(row["length"]) for row in rows], dtype=torch.float64)
    eos = torch.tensor([float(row["eos"]) for row in rows], dtype=torch.float64)
    p10, p50, p90 = torch.quantile(scores, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)).tolist()
    metrics = {
        "preflight/samples": float(len(rows)),
        f"preflight/{key}_mean": scores.mean().item(),
        f"preflight/{key}_std": scores.std(unbiased=False).item(),
        f"preflight/{key}_p10": p10,
        f"preflight/{key}_p50": p50,
        f"preflight/{key}_p90": p90,
        "preflight/eos_frac": eos.mean().item(),
    }
    for part in ("rm_score", "turn_reward") if key == "total_reward" else ():
        metrics[f"preflight/{part}_mean"] = sum(float(row[part]) for row in rows) / len(rows)
    for name, value in (
        ("preflight/length_spearman", spearman(scores, lengths)),
        ("preflight/eos_corr", correlation(scores, eos)),  # point-biserial: a binary variable
    ):
        if value is not None:
            metrics[name] = value
    return metrics


def summarise(rows: Sequence[dict]) -> Preflight:
    """Statistics overall and per slice (rows with a "slice"), and the extreme samples."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        if "slice" in row:
            groups.setdefault(row["slice"], []).append(row)
    slices = {
        name: {"n": len(members), **_slice_statistics(members)} for name, members in sorted(groups.items())
    }
    key = reward_key(rows)
    ranked = sorted(rows, key=lambda row: row[key])
    keep = ("prompt", "response", "rm_score", "turn_reward", "total_reward", "length", "eos", "episode")
    examples = {
        "highest": [{k: row[k] for k in keep if k in row} for row in ranked[::-1][:N_EXAMPLES]],
        "lowest": [{k: row[k] for k in keep if k in row} for row in ranked[:N_EXAMPLES]],
    }
    return Preflight(score_statistics(rows), slices, examples)


def _slice_statistics(rows: Sequence[dict]) -> dict[str, float]:
    """A slice's mean and spread of the score and its mean length (too few rows for correlations)."""
    stats, key = score_statistics(rows), reward_key(rows)
    scores = (f"{key}_mean", f"{key}_std", "eos_frac")
    return {
        **{key: stats[f"preflight/{key}"] for key in scores},
        "length_mean": sum(row["length"] for row in rows) / len(rows),
    }


def preflight_prompts(prompts: Sequence[Prompt], n: int, seed: int, rank: int, world_size: int) -> list[int]:
    """Which ``n`` training prompts to sample, drawn with ``seed`` (the same for every rank): this rank's
    every ``world_size``-th of them."""
    return random.Random(seed).sample(range(len(prompts)), min(n, len(prompts)))[rank::world_size]


def run_preflight(
    cfg,
    policy,
    tokenizer,
    reward_fn,
    prompts: Sequence[Prompt],
    slices: Sequence[str] | None,
    rank: int = 0,
    world_size: int = 1,
    group=None,
    generator=None,
    rows: Sequence[dict] | None = None,
) -> Preflight:
    """Sample ``diagnosis.preflight_batches * rollout.batch_size`` training prompts with ``policy`` as
    training samples them (``generator``: the run's engine when it has its own weights or plays episodes,
    on the prompts' whole ``rows``), score them with
    ``reward_fn``, and summarise (global under a process group: every rank returns the same)."""
    n = min(cfg.diagnosis.preflight_batches * cfg.rollout.batch_size, len(prompts))
    chosen = preflight_prompts(prompts, n, cfg.run.seed, rank, world_size)
    result = evaluate_policy(
        policy,
        tokenizer,
        [prompts[i] for i in chosen],
        reward_fn=reward_fn,
        generator_options=generator_options(cfg),
        slices=None if slices is None else [slices[i] for i in chosen],
        batch_size=cfg.run.eval_batch_size,
        seed=cfg.run.seed,
        group=group,
        generator=generator,
        sample_ids=list(range(n))[rank::world_size],
        rows=None if rows is None else [rows[i] for i in chosen],
    )
    return summarise(result.rows)


def check_rm(cfg) -> tuple[Preflight, Finding | None]:
    """``lmppo check-rm CONFIG``: the run's pre-flight without training (its starting policy, reward and
    prompts, on one process), with the ``reward_bias`` rule's finding."""
    spec = resolve(cfg)
    batches = max(cfg.diagnosis.preflight_batches, 1)  # asked for explicitly: at least one batch
    cfg = cfg.model_copy(
        update={"diagnosis": cfg.diagnosis.model_copy(update={"preflight_batches": batches})}
    )
    policy = load_policy(spec.policy, spec.device)
    reward = load_reward(cfg.reward, spec.rewards, spec.device).reward
    tokenizer = load_tokenizer(spec.policy.source)
    slices = prompt_slices(cfg.data.prompts, cfg.data.split, cfg.data.slice_key)
    generator = policy_generator(cfg, spec, policy, tokenizer)
    rows = load_prompt_rows(cfg.data.prompts, cfg.data.split)
    with autocast(spec.precision, spec.device):
        preflight = run_preflight(
            cfg,
            policy,
            tokenizer,
            reward,
            load_prompts(cfg.data.prompts, cfg.data.split, cfg.data.prompt_key),
            slices,
            generator=generator,
            rows=rows,
        )
    return preflight, reward_bias([{"step": 0, **preflight.metrics}], cfg.diagnosis)


def write_preflight_json(run_dir: str | Path, preflight: Preflight) -> Path:
    path = Path(run_dir) / PREFLIGHT_FILE
    path.write_text(json.dumps(preflight.to_dict(), indent=1) + "\n")
    return path


def preflight_tables(preflight: Preflight) -> list[Table]:
    """``rich`` tables for ``lmppo check-rm``: the statistics, the slices (if any), the extreme samples."""
    stats = Table(title="reward pre-flight: the starting policy's samples")
    stats.add_column("metric")
    stats.add_column("value", justify="right")
    for name, value in preflight.metrics.items():
        stats.add_row(name, f"{value:.4g}")
    tables = [stats]
    if preflight.slices:
        by_slice = Table(title="by slice")
        columns = list(next(iter(preflight.slices.values())))
        for column in ["slice", *columns]:
            by_slice.add_column(column, justify="left" if column == "slice" else "right")
        for name, values in preflight.slices.items():
            by_slice.add_row(name, *(f"{values[c]:.4g}" for c in columns))
        tables.append(by_slice)
    samples = Table(title="highest and lowest scored samples")
    key = reward_key([row for rows in preflight.examples.values() for row in rows])
    for column in ("", key, "length", "eos", "response"):
        samples.add_column(column, justify="right" if column in (key, "length") else "left")
    for which, rows in preflight.examples.items():
        for row in rows:
            samples.add_row(which, f"{row[key]:.4g}", str(row["length"]), str(row["eos"]), _response(row))
    return [*tables, samples]


def _response(row: dict) -> str | Text:
    """The response; an episode's whole transcript, the context between the policy's turns dimmed (as the
    report greys it): its length counts every turn."""
    if "episode" not in row:
        return row["response"]
    return Text.assemble(*((run["text"], "" if run["action"] else "dim") for run in row["episode"]))


def summary_line(preflight: Preflight) -> str:
    """One line for the console: the score distribution and the two correlations."""
    m = preflight.metrics
    key = "total_reward" if "preflight/total_reward_mean" in m else "rm_score"
    final, turn = m.get("preflight/rm_score_mean"), m.get("preflight/turn_reward_mean")
    parts = f" (final {final:.3g}, turn {turn:.3g})" if key == "total_reward" and final and turn else ""
    correlations = [
        f"{label} {m[name]:+.2f}"
        for name, label in (
            ("preflight/length_spearman", "Spearman with length"),
            ("preflight/eos_corr", "with EOS"),
        )
        if name in m
    ]
    return (
        f"reward pre-flight on {m['preflight/samples']:.0f} samples of the starting policy: "
        f"{'reward' if key == 'total_reward' else 'score'} {m[f'preflight/{key}_mean']:.3g} ± "
        f"{m[f'preflight/{key}_std']:.3g}{parts} (p10 {m[f'preflight/{key}_p10']:.3g}, "
        f"p90 {m[f'preflight/{key}_p90']:.3g}); " + ", ".join(correlations or ["no correlation defined"])
    )
