"""The seeds' table of PPO failure modes as rules over a run's metric history: pure functions, no models.

Each rule reads the records of ``metrics.jsonl`` (one dict per step, as :func:`lmppo.metrics.read_metrics`
returns them) and the thresholds of the config's ``diagnosis:`` section, and returns a :class:`Finding`
(the evidence: which metrics, which steps, the numbers; the likely cause; the config keys to change) or
None. ``lmppo diagnose RUN_DIR`` runs them all on any run directory, finished, aborted or running.

| rule | symptom | likely cause | fix |
|---|---|---|---|
| over_optimisation | training reward up, held-out judge (else held-out RM) not; or KL past the hacking level | the policy exploits the reward model | lower the KL target / raise beta, stop at `best/`, retrain the RM |
| kl_explosion | KL past the hacking level within the first steps | lr too high, beta too low, too many epochs | adaptive KL, 1-2 epochs, `ppo.target_approx_kl` |
| reward_flat | reward flat while the clip fraction stays ~0 | advantages tiny: reward scale, lr | `reward.normalize`, a larger `ppo.lr` |
| critic_weak | explained variance < 0 at the end, or the value loss growing | the critic starts far from the returns, or diverges | `ppo.critic_warmup_steps`, `ppo.value_lr`, `ppo.vf_coef` |
| entropy_collapse | entropy falls to a small share of its start | beta too low, no entropy term | raise `kl.beta`, a small `ppo.ent_coef` |
| length_drift | responses run into max_new_tokens, or shrink to nothing | the reward pays for length (or brevity) | `reward.missing_eos_penalty`, a length-neutral reward, `rollout.max_new_tokens` |
| stale_batches | clip fraction above ~0.3 | the batch is over-used or the data is stale | fewer `ppo.ppo_epochs`, lower `ppo.lr`, `rollout.max_rollout_age` |
| nonfinite | NaN or infinite metrics, skipped updates | where they start: the reward, the critic, the update | a finite reward; lower learning rates; keep gradient clipping |
| reward_bias | the pre-flight's reward correlates with length or with ending on EOS | the reward carries a length or truncation bias PPO will exploit | a length-balanced RM, `reward.missing_eos_penalty`, watch `response/length` |
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from lmppo.config import DiagnosisConfig
from lmppo.metrics import read_metrics


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


def over_optimisation(records: Records, cfg: DiagnosisConfig) -> Finding | None:
    """The training reward (the combined score, or any one component of it) up while held-out quality is not."""
    train = series(records, "reward/rm_score")
    metric = "eval/gold_score" if series(records, "eval/gold_score") else "eval/reward/rm_score"
    held_out = series(records, metric)
    if len(train) < cfg.min_steps or len(held_out) < 3:  # too few evaluations to judge a trend
        kl = series(records, "kl/ref")
        if not held_out and kl and kl[-1][1] > cfg.kl_hacking_nats and len(train) >= cfg.min_steps:
            return Finding(
                "over_optimisation",
                (kl[0][0], kl[-1][0]),
                f"kl/ref reached {kl[-1][1]:.1f} nats (diagnosis.kl_hacking_nats={cfg.kl_hacking_nats:g}) with no "
                "held-out evaluation to tell whether quality followed",
                "the policy moved far from the reference, the usual sign of reward hacking",
                "set data.eval_prompts and run.eval_every to watch held-out quality; lower kl.target or raise "
                "kl.beta",
            )
        return None
    start, last = held_out[0][1], held_out[-1][1]
    best_step, best_before = max(held_out[:-1], key=lambda point: point[1])
    kept = (last - start) / (best_before - start) if best_before > start else 1.0
    if last > start and kept >= cfg.held_out_keep:
        return None
    components = sorted(
        {key for r in records for key in r if key.startswith("reward/") and key.endswith("/raw")}
    )
    for reward in ("reward/rm_score", *components):
        points = series(records, reward)
        rise, spread = _rise(points, cfg.window)
        spread = spread or 1.0
        if len(points) >= cfg.min_steps and rise / spread >= cfg.reward_rise_std:
            return Finding(
                "over_optimisation",
                (held_out[0][0], held_out[-1][0]),
                f"{reward} rose by {rise:.3g} ({rise / spread:.1f} std) while {metric} went "
                f"{start:.3g} -> {last:.3g}, below its best {best_before:.3g} at step {best_step}",
                "the policy exploits the reward model instead of getting better (Gao et al. 2022)",
                "keep the policy of the best held-out step (best/); lower kl.target or raise kl.beta; fewer "
                "ppo.ppo_epochs; retrain the reward model on the policy's own samples",
            )
    return None


def kl_explosion(records: Records, cfg: DiagnosisConfig) -> Finding | None:
    kl = series(records, "kl/ref")
    early = kl[: max(cfg.min_steps, len(kl) // 5)]
    over = [(step, value) for step, value in early if value > cfg.kl_hacking_nats]
    if not over:
        return None
    return Finding(
        "kl_explosion",
        (early[0][0], over[0][0]),
        f"kl/ref {over[0][1]:.1f} nats at step {over[0][0]}, past diagnosis.kl_hacking_nats={cfg.kl_hacking_nats:g} "
        f"within the first {len(early)} steps",
        "a learning rate too high, a KL coefficient too low, or too many PPO epochs per batch",
        "kl.adaptive=true with kl.target; ppo.ppo_epochs=1 or 2; ppo.target_approx_kl=0.1; a lower ppo.lr",
    )


def reward_flat(records: Records, cfg: DiagnosisConfig) -> Finding | None:
    reward, clip = series(records, "reward/rm_score"), series(records, "policy/clip_frac")
    if len(reward) < cfg.min_steps or not clip:
        return None
    rise, noise = _rise(reward, cfg.window)
    clip_mean = statistics.fmean(value for _, value in clip)
    if clip_mean > cfg.clip_frac_low or abs(rise) > max(noise, 1e-12) * cfg.reward_rise_std:
        return None
    return Finding(
        "reward_flat",
        (reward[0][0], reward[-1][0]),
        f"reward/rm_score moved by {rise:.3g} over {len(reward)} steps while policy/clip_frac averaged "
        f"{clip_mean:.4f} (diagnosis.clip_frac_low={cfg.clip_frac_low:g})",
        "the updates are tiny: the advantages are small (reward scale, a critic that already predicts the "
        "return) or the learning rate is",
        "reward.normalize=true (or ppo.whiten_advantages=true); a larger ppo.lr",
    )


def critic_weak(records: Records, cfg: DiagnosisConfig) -> Finding | None:
    explained = series(records, "value/explained_var")
    recent = _recent(explained, cfg)
    if len(explained) >= cfg.min_steps and statistics.fmean(v for _, v in recent) < 0:
        return Finding(
            "critic_weak",
            (recent[0][0], recent[-1][0]),
            f"value/explained_var averaged {statistics.fmean(v for _, v in recent):.3g} over the last "
            f"{len(recent)} steps (below 0: worse than predicting the mean return)",
            "the critic started far from the returns and has not caught up",
            "ppo.critic_warmup_steps (train the critic alone first); ppo.value_lr; ppo.vf_coef",
        )
    value = series(records, "value/loss")
    if len(value) < cfg.min_steps:
        return None
    start, end = _ends(value, cfg.window)
    if start <= 0 or end < cfg.value_loss_growth * start:
        return None
    return Finding(
        "critic_weak",
        (value[0][0], value[-1][0]),
        f"value/loss grew {start:.3g} -> {end:.3g} (x{end / start:.1f}; diagnosis.value_loss_growth="
        f"{cfg.value_loss_growth:g})",
        "the critic diverges, and its loss destabilises the update",
        "a lower ppo.value_lr; ppo.value_clip_eps; ppo.critic_warmup_steps; ppo.max_grad_norm",
    )


def entropy_collapse(records: Records, cfg: DiagnosisConfig) -> Finding | None:
    entropy = series(records, "policy/entropy")
    if len(entropy) < cfg.min_steps:
        return None
    start, end = _ends(entropy, cfg.window)
    if start <= 0 or end > cfg.entropy_floor * start:
        return None
    return Finding(
        "entropy_collapse",
        (entropy[0][0], entropy[-1][0]),
        f"policy/entropy fell {start:.3g} -> {end:.3g} ({end / start:.0%} of its start; "
        f"diagnosis.entropy_floor={cfg.entropy_floor:g})",
        "the policy collapses onto a few stereotyped responses: the KL coefficient is too low and there is no "
        "entropy term",
        "raise kl.beta (or kl.target); a small ppo.ent_coef such as 0.01",
    )


def length_drift(records: Records, cfg: DiagnosisConfig) -> Finding | None:
    truncated = series(records, "response/truncated_frac")
    length = series(records, "response/length")
    if len(truncated) >= cfg.min_steps:
        start, end = _ends(truncated, cfg.window)
        if end >= cfg.truncated_frac_high and end > start:
            return Finding(
                "length_drift",
                (truncated[0][0], truncated[-1][0]),
                f"response/truncated_frac rose {start:.2f} -> {end:.2f}: responses run into rollout.max_new_tokens "
                f"(diagnosis.truncated_frac_high={cfg.truncated_frac_high:g})",
                "the reward pays for length (a length-biased reward model, or no cost for never ending)",
                "reward.missing_eos_penalty; a length-neutral reward (check the pre-flight's length correlation); "
                "kl.beta",
            )
    if len(length) >= cfg.min_steps:
        start, end = _ends(length, cfg.window)
        if start > 0 and end < cfg.length_shrink * start:
            return Finding(
                "length_drift",
                (length[0][0], length[-1][0]),
                f"response/length shrank {start:.1f} -> {end:.1f} tokens (below diagnosis.length_shrink="
                f"{cfg.length_shrink:g} of its start)",
                "the reward pays for brevity, or an early stop token became a cheap way to avoid penalties",
                "a reward that does not favour empty answers; kl.beta",
            )
    return None


def stale_batches(records: Records, cfg: DiagnosisConfig) -> Finding | None:
    clip = series(records, "policy/clip_frac")
    recent = _recent(clip, cfg)
    if len(clip) < cfg.min_steps or statistics.fmean(v for _, v in recent) <= cfg.clip_frac_high:
        return None
    lag = [v for _, v in series(records, "lag/policy_versions") if v > 0]
    stale = f"; rollouts lagged the policy on {len(lag)} steps" if lag else ""
    return Finding(
        "stale_batches",
        (recent[0][0], recent[-1][0]),
        f"policy/clip_frac averaged {statistics.fmean(v for _, v in recent):.2f} over the last {len(recent)} "
        f"steps (diagnosis.clip_frac_high={cfg.clip_frac_high:g}){stale}",
        "each batch is over-used (too many epochs or too large a learning rate), or the data is stale",
        "fewer ppo.ppo_epochs; a lower ppo.lr; ppo.target_approx_kl; rollout.max_rollout_age=0",
    )


def reward_bias(records: Records, cfg: DiagnosisConfig) -> Finding | None:
    """The reward pre-flight (lmppo.preflight, step 0): before training, the score follows the response
    length either way, or favours responses cut at the length limit over those that end on EOS."""
    samples = series(records, "preflight/samples")
    length, eos = series(records, "preflight/length_spearman"), series(records, "preflight/eos_corr")
    if length and abs(length[0][1]) >= cfg.length_corr_high:
        metric, field, value = "preflight/length_spearman", "length_corr_high", length[0][1]
        favoured = "longer responses" if value > 0 else "shorter responses"
    elif eos and eos[0][1] <= -cfg.eos_corr_high:
        metric, field, value = "preflight/eos_corr", "eos_corr_high", eos[0][1]
        favoured = "responses cut at rollout.max_new_tokens over those that end on EOS"
    else:
        return None
    return Finding(
        "reward_bias",
        (0, 0),
        f"{metric} = {value:+.2f} on {samples[0][1]:.0f} samples of the starting policy (|{value:.2f}| >= "
        f"diagnosis.{field}={getattr(cfg, field):g}): the reward favours {favoured}",
        "a scalar reward carries a length or truncation bias, and PPO moves the policy along it rather "
        "than towards better answers",
        "check the reward by length slice and retrain it on length-balanced pairs; reward.missing_eos_penalty "
        "for cut responses; a KL anchor strong enough (kl.beta, kl.target); watch response/length",
    )


# Where non-finite values start says what broke: the first family with a non-finite metric wins ...
NONFINITE_CAUSES: tuple[tuple[Callable[[str], bool], str, str], ...] = (
    (
        lambda name: name == "reward/rm_score" or name.endswith("/raw"),
        "the reward produced non-finite scores",
        "make the reward return a finite number for every response",
    ),
    (
        lambda name: name.startswith("value/"),
        "the critic diverged: its predictions or its loss overflowed",
        "a lower ppo.value_lr or ppo.vf_coef; reward.normalize or reward.clip; keep ppo.max_grad_norm set",
    ),
)
# ... and where neither did: the policy's own update
NONFINITE_IN_UPDATE = (
    "the update overflowed: a learning rate too high, float16 overflow, or gradients without clipping",
    "a lower ppo.lr; run.precision=bf16 or fp32; keep ppo.max_grad_norm set",
)


def nonfinite_cause(names: Sequence[str]) -> tuple[str, str]:
    """(likely cause, fix) of non-finite values in the metrics ``names``: the guard and the rule say the same."""
    for in_family, cause, fix in NONFINITE_CAUSES:
        if any(in_family(name) for name in names):
            return cause, fix
    return NONFINITE_IN_UPDATE


def nonfinite(records: Records, cfg: DiagnosisConfig) -> Finding | None:
    """NaN or infinite metrics, or updates skipped for a non-finite gradient (``health/nonfinite``)."""
    bad = [
        (r["step"], sorted(k for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)))
        for r in records
        if r.get("health/nonfinite", 0) > 0
        or any(isinstance(v, float) and not math.isfinite(v) for v in r.values())
    ]
    if not bad:
        return None
    (first, names), last = bad[0], bad[-1][0]
    cause, fix = nonfinite_cause(names)
    seen = ", ".join(names) or "health/nonfinite > 0"
    return Finding(
        "nonfinite",
        (first, last),
        f"non-finite values on {len(bad)} steps from step {first} ({seen})",
        cause,
        fix,
    )


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
