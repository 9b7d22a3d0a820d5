"""The failure modes of :mod:`lmppo.runs.failure_modes` as rules over a run's metric history: pure functions,
no models.

Each rule reads the records of ``metrics.jsonl`` (one dict per step, as
:func:`lmppo.training.metrics.read_metrics` returns them) and its modes' ``warn`` thresholds in the config's
``diagnosis:`` section, and returns a :class:`Finding` (the evidence: which metrics, which steps, the numbers;
the mode's likely cause and the config keys to change) or None. A rule may report one of several modes
(``critic_weak``: a critic behind the returns or a diverging one); every mode a guard stops a run on is among
them. ``lmppo diagnose RUN_DIR`` runs them all on any run directory, finished, aborted or running. The rules
in a table: docs/diagnosis.md.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from lmppo.inputs.config import DiagnosisConfig
from lmppo.runs.failure_modes import (
    CLIP_FRACTION,
    CRITIC_BEHIND,
    ENTROPY_COLLAPSE,
    EOS_BIAS,
    HELD_OUT_SCORES,
    KL_BLOWUP,
    KL_WITHOUT_EVAL,
    LENGTH_BIAS,
    LENGTH_GROWTH,
    LENGTH_SHRINK,
    NONFINITE_UPDATE,
    POLICY_LAG,
    REWARD_FLAT,
    REWARD_HACKING,
    TRAINING_SCORE,
    VALUE_DIVERGENCE,
    FailureMode,
    nonfinite_mode,
)
from lmppo.training.metrics import read_metrics


@dataclass(frozen=True)
class Finding:
    """One diagnosed failure mode: what was seen, where, why it likely happens and what to change."""

    rule: str
    steps: tuple[int, int]  # first and last step of the evidence
    evidence: str
    cause: str
    fix: str

    def __str__(self) -> str:
        return (
            f"{self.rule} (steps {self.steps[0]}-{self.steps[1]}): {self.evidence}. Likely cause: {self.cause}. "
            f"Change: {self.fix}."
        )


Records = Sequence[dict]


def series(records: Records, metric: str) -> list[tuple[int, float]]:
    """(step, value) of every record that logged a finite ``metric``."""
    return [
        (r["step"], float(r[metric]))
        for r in records
        if isinstance(r.get(metric), float | int) and math.isfinite(r[metric])
    ]


def _ends(points: list[tuple[int, float]], share: float) -> tuple[float, float]:
    """Means of the first and of the last ``share`` of the points (at least one each): a trend's ends."""
    n = max(1, round(len(points) * share))
    return statistics.fmean(v for _, v in points[:n]), statistics.fmean(v for _, v in points[-n:])


def _rise(points: list[tuple[int, float]], share: float) -> tuple[float, float]:
    """How far a trend moved between its ends (:func:`_ends`), and the points' spread (population std)."""
    first, final = _ends(points, share)
    return final - first, statistics.pstdev(value for _, value in points)


def _recent(points: list[tuple[int, float]], cfg: DiagnosisConfig) -> list[tuple[int, float]]:
    """The last ``window`` share of the points, at least ``min_steps``."""
    return points[-max(cfg.min_steps, round(len(points) * cfg.window)) :]


def _finding(mode: FailureMode, steps: tuple[int, int], evidence: str) -> Finding:
    """A finding of ``mode``: the rule's evidence in the table's words."""
    return Finding(mode.finding, steps, evidence, mode.cause, mode.fix)


def _threshold(mode: FailureMode, cfg: DiagnosisConfig) -> float:
    """``mode``'s warning threshold in ``cfg``."""
    return getattr(cfg, mode.warn.key)


def _setting(mode: FailureMode, cfg: DiagnosisConfig) -> str:
    """How the evidence names ``mode``'s warning threshold: ``diagnosis.key=value``."""
    return f"diagnosis.{mode.warn.key}={_threshold(mode, cfg):g}"


def training_score(records: Records) -> str:
    """What the run optimised: with episodes the turn rewards plus the final score (``reward/total``), else the
    reward's score."""
    return "reward/total" if any("reward/total" in r for r in records) else TRAINING_SCORE


def over_optimisation(records: Records, cfg: DiagnosisConfig) -> Finding | None:
    """The training reward (the combined score, or any one component of it) up while held-out quality is not;
    with no held-out evaluation at all, the KL past the level of reward hacking."""
    if len(series(records, training_score(records))) < cfg.min_steps:
        return None
    judge, rm = HELD_OUT_SCORES
    metric = judge if series(records, judge) else rm
    held_out = series(records, metric)
    if len(held_out) < 3:  # too few evaluations to judge a trend
        return None if held_out else _kl_without_eval(records, cfg)
    start, last = held_out[0][1], held_out[-1][1]
    best_step, best_before = max(held_out[:-1], key=lambda point: point[1])
    kept = (last - start) / (best_before - start) if best_before > start else 1.0
    if last > start and kept >= _threshold(REWARD_HACKING, cfg):
        return None
    rising = _rising_reward(records, cfg)
    if rising is None:
        return None
    reward, rise, spread = rising
    return _finding(
        REWARD_HACKING,
        (held_out[0][0], held_out[-1][0]),
        f"{reward} rose by {rise:.3g} ({rise / spread:.1f} std) while {metric} went {start:.3g} -> {last:.3g}, "
        f"below its best {best_before:.3g} at step {best_step}",
    )


def _rising_reward(records: Records, cfg: DiagnosisConfig) -> tuple[str, float, float] | None:
    """(metric, rise, spread) of the first training reward, the combined score or a component's raw one,
    that rose by ``reward_rise_std`` of its spread."""
    components = sorted(
        {key for r in records for key in r if key.startswith("reward/") and key.endswith("/raw")}
    )
    for reward in (training_score(records), *components):
        points = series(records, reward)
        rise, spread = _rise(points, cfg.window)
        spread = spread or 1.0
        if len(points) >= cfg.min_steps and rise / spread >= cfg.reward_rise_std:
            return reward, rise, spread
    return None


def _kl_without_eval(records: Records, cfg: DiagnosisConfig) -> Finding | None:
    kl = series(records, KL_WITHOUT_EVAL.warn.metric)
    if not kl or kl[-1][1] <= _threshold(KL_WITHOUT_EVAL, cfg):
        return None
    return _finding(
        KL_WITHOUT_EVAL,
        (kl[0][0], kl[-1][0]),
        f"{KL_WITHOUT_EVAL.warn.metric} reached {kl[-1][1]:.1f} nats ({_setting(KL_WITHOUT_EVAL, cfg)}) with no held-out evaluation "
        "to tell whether quality followed",
    )


def kl_explosion(records: Records, cfg: DiagnosisConfig) -> Finding | None:
    kl = series(records, KL_BLOWUP.warn.metric)
    early = kl[: max(cfg.min_steps, len(kl) // 5)]
    over = [(step, value) for step, value in early if value > _threshold(KL_BLOWUP, cfg)]
    if not over:
        return None
    return _finding(
        KL_BLOWUP,
        (early[0][0], over[0][0]),
        f"{KL_BLOWUP.warn.metric} {over[0][1]:.1f} nats at step {over[0][0]}, past {_setting(KL_BLOWUP, cfg)} within the first "
        f"{len(early)} steps",
    )


def reward_flat(records: Records, cfg: DiagnosisConfig) -> Finding | None:
    score = training_score(records)
    reward, clip = series(records, score), series(records, REWARD_FLAT.warn.metric)
    if len(reward) < cfg.min_steps or not clip:
        return None
    rise, noise = _rise(reward, cfg.window)
    clip_mean = statistics.fmean(value for _, value in clip)
    if clip_mean > _threshold(REWARD_FLAT, cfg) or abs(rise) > max(noise, 1e-12) * cfg.reward_rise_std:
        return None
    return _finding(
        REWARD_FLAT,
        (reward[0][0], reward[-1][0]),
        f"{score} moved by {rise:.3g} over {len(reward)} steps while {REWARD_FLAT.warn.metric} averaged "
        f"{clip_mean:.4f} ({_setting(REWARD_FLAT, cfg)})",
    )


def critic_weak(records: Records, cfg: DiagnosisConfig) -> Finding | None:
    """A diverging critic, else one that predicts the returns worse than their mean (the divergence first: it
    also keeps the explained variance down)."""
    return _value_divergence(records, cfg) or _critic_behind(records, cfg)


def _value_divergence(records: Records, cfg: DiagnosisConfig) -> Finding | None:
    value = series(records, VALUE_DIVERGENCE.warn.metric)
    if len(value) < cfg.min_steps:
        return None
    start, end = _ends(value, cfg.window)
    if start <= 0 or end < _threshold(VALUE_DIVERGENCE, cfg) * start:
        return None
    return _finding(
        VALUE_DIVERGENCE,
        (value[0][0], value[-1][0]),
        f"{VALUE_DIVERGENCE.warn.metric} grew {start:.3g} -> {end:.3g} (x{end / start:.1f}; {_setting(VALUE_DIVERGENCE, cfg)})",
    )


def _critic_behind(records: Records, cfg: DiagnosisConfig) -> Finding | None:
    explained = series(records, CRITIC_BEHIND.warn.metric)
    if len(explained) < cfg.min_steps:
        return None
    recent = _recent(explained, cfg)
    mean = statistics.fmean(v for _, v in recent)
    if mean >= CRITIC_BEHIND.warn.fixed:
        return None
    return _finding(
        CRITIC_BEHIND,
        (recent[0][0], recent[-1][0]),
        f"{CRITIC_BEHIND.warn.metric} averaged {mean:.3g} over the last {len(recent)} steps (below "
        f"{CRITIC_BEHIND.warn.fixed:g}: worse than predicting the mean return)",
    )


def entropy_collapse(records: Records, cfg: DiagnosisConfig) -> Finding | None:
    entropy = series(records, ENTROPY_COLLAPSE.warn.metric)
    if len(entropy) < cfg.min_steps:
        return None
    start, end = _ends(entropy, cfg.window)
    if start <= 0 or end > _threshold(ENTROPY_COLLAPSE, cfg) * start:
        return None
    return _finding(
        ENTROPY_COLLAPSE,
        (entropy[0][0], entropy[-1][0]),
        f"{ENTROPY_COLLAPSE.warn.metric} fell {start:.3g} -> {end:.3g} ({end / start:.0%} of its start; "
        f"{_setting(ENTROPY_COLLAPSE, cfg)})",
    )


def length_drift(records: Records, cfg: DiagnosisConfig) -> Finding | None:
    """Responses that grow into max_new_tokens, else responses that shrink to nothing."""
    return _length_growth(records, cfg) or _length_shrink(records, cfg)


def _length_growth(records: Records, cfg: DiagnosisConfig) -> Finding | None:
    truncated = series(records, LENGTH_GROWTH.warn.metric)
    if len(truncated) < cfg.min_steps:
        return None
    start, end = _ends(truncated, cfg.window)
    if end < _threshold(LENGTH_GROWTH, cfg) or end <= start:
        return None
    return _finding(
        LENGTH_GROWTH,
        (truncated[0][0], truncated[-1][0]),
        f"{LENGTH_GROWTH.warn.metric} rose {start:.2f} -> {end:.2f}: responses run into rollout.max_new_tokens "
        f"({_setting(LENGTH_GROWTH, cfg)})",
    )


def _length_shrink(records: Records, cfg: DiagnosisConfig) -> Finding | None:
    length = series(records, LENGTH_SHRINK.warn.metric)
    if len(length) < cfg.min_steps:
        return None
    start, end = _ends(length, cfg.window)
    if start <= 0 or end >= _threshold(LENGTH_SHRINK, cfg) * start:
        return None
    return _finding(
        LENGTH_SHRINK,
        (length[0][0], length[-1][0]),
        f"{LENGTH_SHRINK.warn.metric} shrank {start:.1f} -> {end:.1f} tokens (below "
        f"{_setting(LENGTH_SHRINK, cfg)} of its start)",
    )


def stale_batches(records: Records, cfg: DiagnosisConfig) -> Finding | None:
    """Most tokens clipped over the last steps, else rollouts lagging the policy by more than one version."""
    return _clipped(records, cfg) or _lagging(records)


def _clipped(records: Records, cfg: DiagnosisConfig) -> Finding | None:
    clip = series(records, CLIP_FRACTION.warn.metric)
    recent = _recent(clip, cfg)
    if len(clip) < cfg.min_steps or statistics.fmean(v for _, v in recent) <= _threshold(CLIP_FRACTION, cfg):
        return None
    lag = [v for _, v in series(records, POLICY_LAG.warn.metric) if v > 0]
    stale = f"; rollouts lagged the policy on {len(lag)} steps" if lag else ""
    return _finding(
        CLIP_FRACTION,
        (recent[0][0], recent[-1][0]),
        f"{CLIP_FRACTION.warn.metric} averaged {statistics.fmean(v for _, v in recent):.2f} over the last "
        f"{len(recent)} steps ({_setting(CLIP_FRACTION, cfg)}){stale}",
    )


def _lagging(records: Records) -> Finding | None:
    lagged = [(step, v) for step, v in series(records, POLICY_LAG.warn.metric) if v > POLICY_LAG.warn.fixed]
    if not lagged:
        return None
    return _finding(
        POLICY_LAG,
        (lagged[0][0], lagged[-1][0]),
        f"{POLICY_LAG.warn.metric} reached {max(v for _, v in lagged):.0f} on {len(lagged)} steps (more than "
        f"{POLICY_LAG.warn.fixed:g}, the lag of one-step-off asynchronous rollouts)",
    )


def reward_bias(records: Records, cfg: DiagnosisConfig) -> Finding | None:
    """The reward pre-flight (lmppo.runs.preflight, step 0): before training, the score follows the response
    length either way, or favours responses cut at the length limit over those that end on EOS."""
    samples = series(records, "preflight/samples")
    length, eos = series(records, LENGTH_BIAS.warn.metric), series(records, EOS_BIAS.warn.metric)
    if length and abs(length[0][1]) >= _threshold(LENGTH_BIAS, cfg):
        mode, value = LENGTH_BIAS, length[0][1]
        favoured = "longer responses" if value > 0 else "shorter responses"
    elif eos and eos[0][1] <= -_threshold(EOS_BIAS, cfg):
        mode, value = EOS_BIAS, eos[0][1]
        favoured = "responses cut at rollout.max_new_tokens over those that end on EOS"
    else:
        return None
    return _finding(
        mode,
        (0, 0),
        f"{mode.warn.metric} = {value:+.2f} on {samples[0][1]:.0f} samples of the starting policy (|{value:.2f}| "
        f">= {_setting(mode, cfg)}): the reward favours {favoured}",
    )


def nonfinite(records: Records, cfg: DiagnosisConfig) -> Finding | None:
    """NaN or infinite metrics, or updates skipped for a non-finite gradient (``health/nonfinite``)."""
    count = NONFINITE_UPDATE.warn  # every non-finite mode's: where they start is read from the names
    bad = [
        (r["step"], sorted(k for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)))
        for r in records
        if r.get(count.metric, 0) > count.fixed
        or any(isinstance(v, float) and not math.isfinite(v) for v in r.values())
    ]
    if not bad:
        return None
    (first, names), last = bad[0], bad[-1][0]
    mode = nonfinite_mode(names)
    seen = ", ".join(names) or f"{count.metric} > {count.fixed:g}"
    return _finding(mode, (first, last), f"non-finite values on {len(bad)} steps from step {first} ({seen})")


RULES: tuple[Callable[[Records, DiagnosisConfig], Finding | None], ...] = (
    nonfinite,
    over_optimisation,
    kl_explosion,
    reward_flat,
    critic_weak,
    entropy_collapse,
    length_drift,
    stale_batches,
    reward_bias,
)


def diagnose(records: Records, cfg: DiagnosisConfig | None = None) -> list[Finding]:
    """Every rule's finding on ``records`` (training steps; step 0 holds only the first evaluation)."""
    cfg = cfg or DiagnosisConfig()
    return [finding for rule in RULES if (finding := rule(records, cfg)) is not None]


class LiveDiagnosis:
    """The rules over a running run's history, after every logged record: :meth:`add` returns the
    findings to show now. A rule is shown again only ``diagnosis.warn_every`` steps after it last was
    (its numbers change every step; its message would not)."""

    def __init__(self, cfg: DiagnosisConfig, records: Records = ()) -> None:
        self.cfg, self.records = cfg, list(records)
        self.shown_at: dict[str, int] = {}

    def add(self, step: int, metrics: dict[str, float]) -> list[Finding]:
        self.records.append({"step": step, **metrics})
        if self.cfg.warn_every is None:
            return []
        due = [
            finding
            for finding in self.findings()
            if step - self.shown_at.get(finding.rule, -self.cfg.warn_every) >= self.cfg.warn_every
        ]
        self.shown_at.update((finding.rule, step) for finding in due)
        return due

    def findings(self) -> list[Finding]:
        return diagnose(self.records, self.cfg)


def run_thresholds(run_dir: str | Path) -> DiagnosisConfig:
    """The ``diagnosis:`` section of the run's ``config.yaml`` (the defaults when it has none)."""
    config = Path(run_dir) / "config.yaml"
    section = (yaml.safe_load(config.read_text()) or {}).get("diagnosis") if config.is_file() else None
    return DiagnosisConfig.model_validate(section or {})


def diagnose_run(run_dir: str | Path) -> list[Finding]:
    """``lmppo diagnose RUN_DIR``: the rules on a run's ``metrics.jsonl``, with its config's thresholds."""
    return diagnose(read_metrics(run_dir), run_thresholds(run_dir))
