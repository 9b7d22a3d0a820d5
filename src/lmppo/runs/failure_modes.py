"""The PPO failure modes, one row each: the metric a mode shows in, the thresholds that warn and stop, its
likely cause and the config keys to change. Both judges of a run read this one table, so a mode's words and
thresholds are written once:

- the guards (:mod:`lmppo.runs.guards`) stop a run when a step crosses a row's ``stop`` threshold, a
  ``guards.*`` key;
- the diagnosis (:mod:`lmppo.runs.diagnose`) explains a run from a row's ``warn`` threshold, a ``diagnosis.*``
  key judged on the metric history (often against the metric's own start: a share of it, a growth).

Every mode the guards stop is one the diagnosis explains (tests/test_failure_modes.py). Plain data with no
lmppo import, so the guards stay light. Healthy ranges: docs/metrics.md; the rules: docs/diagnosis.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from fnmatch import fnmatchcase

TRAINING_SCORE = "reward/rm_score"
HELD_OUT_SCORES = ("eval/gold_score", "eval/reward/rm_score")  # the judge's when there is one, else the RM's


@dataclass(frozen=True)
class Threshold:
    """A threshold on one metric, crossed when the metric goes above it (``upper``) or below: the value of a
    config field (``key``), or one ``fixed`` by what the metric means."""

    key: str | None  # a GuardsConfig field for a stop threshold, a DiagnosisConfig field for a warning
    metric: str
    upper: bool
    fixed: float | None = None


@dataclass(frozen=True)
class FailureMode:
    """One way a run fails, as the diagnosis and (where ``stop`` is set) the guards see it."""

    name: str
    finding: str  # the diagnosis rule that reports it (``Finding.rule``); related modes share one
    warn: Threshold  # the diagnosis's, judged on the history
    cause: str
    fix: str  # what to change, naming config keys
    stop: Threshold | None = None  # the guard's, judged on each step; None: nothing stops the run on it
    guard: str | None = None  # the guard's rule (``GuardViolation.rule``) that judges ``stop``
    after_warmup: bool = False  # the guard waits out guards.warmup_steps: noisy while a run settles
    blames: tuple[str, ...] = ()  # non-finite modes: metrics (fnmatch patterns) that point here


NONFINITE_UPDATE = FailureMode(
    name="nonfinite_update",
    finding="nonfinite",
    warn=Threshold(None, "health/nonfinite", upper=True, fixed=0.0),  # or any metric NaN or infinite
    stop=Threshold("nonfinite_patience", "health/nonfinite", upper=True),  # that many steps in a row
    guard="nonfinite",
    cause="the update overflowed: a learning rate too high, float16 overflow, or gradients without clipping",
    fix="a lower ppo.lr; run.precision=bf16 or fp32; keep ppo.max_grad_norm set",
)
# Where non-finite values start says what broke: the reward, else the critic, else (above) the update.
NONFINITE_REWARD = replace(
    NONFINITE_UPDATE,
    name="nonfinite_reward",
    blames=(TRAINING_SCORE, "*/raw"),
    cause="the reward produced non-finite scores",
    fix="make the reward return a finite number for every response",
)
NONFINITE_CRITIC = replace(
    NONFINITE_UPDATE,
    name="nonfinite_critic",
    blames=("value/*",),
    cause="the critic diverged: its predictions or its loss overflowed",
    fix="a lower ppo.value_lr or ppo.vf_coef; reward.normalize or reward.clip; keep ppo.max_grad_norm set",
)

REWARD_HACKING = FailureMode(
    name="reward_hacking",
    finding="over_optimisation",
    # the held-out score keeps less than this share of its best gain while the training score rises
    warn=Threshold("held_out_keep", HELD_OUT_SCORES[0], upper=False),
    # the training score rises over this many evaluations while the held-out score never beats the first
    stop=Threshold("reward_without_eval_patience", TRAINING_SCORE, upper=True),
    guard="reward_without_eval",
    cause="the policy exploits the reward model instead of getting better (Gao et al. 2022)",
    fix="keep the policy of the best held-out step (best/); lower kl.target or raise kl.beta; fewer "
    "ppo.ppo_epochs; retrain the reward model on the policy's own samples",
)
KL_BLOWUP = FailureMode(
    name="kl_blowup",
    finding="kl_explosion",
    warn=Threshold("kl_hacking_nats", "kl/ref", upper=True),  # within the first fifth of the steps
    stop=Threshold("kl_max", "kl/ref", upper=True),
    guard="kl_budget",
    cause="the policy drifted far from the reference, often by exploiting the reward model: a learning "
    "rate too high, a KL coefficient too low, or too many PPO epochs per batch",
    fix="raise kl.beta, or kl.adaptive=true with a lower kl.target; ppo.ppo_epochs=1 or 2; "
    "ppo.target_approx_kl=0.1; a lower ppo.lr",
)
KL_WITHOUT_EVAL = FailureMode(
    name="kl_without_eval",
    finding="over_optimisation",
    warn=Threshold("kl_hacking_nats", "kl/ref", upper=True),  # with no held-out score to say otherwise
    cause="the policy moved far from the reference, the usual sign of reward hacking",
    fix="set data.eval_prompts and run.eval_every to watch held-out quality; lower kl.target or raise kl.beta",
)
REWARD_FLAT = FailureMode(
    name="reward_flat",
    finding="reward_flat",
    warn=Threshold("clip_frac_low", "policy/clip_frac", upper=False),  # with the training score flat
    cause="the updates are tiny: the advantages are small (reward scale, a critic that already predicts the "
    "return) or the learning rate is",
    fix="reward.normalize=true (or ppo.whiten_advantages=true); a larger ppo.lr",
)
CRITIC_BEHIND = FailureMode(
    name="critic_behind",
    finding="critic_weak",
    # below 0 the critic predicts the returns worse than their mean does
    warn=Threshold(None, "value/explained_var", upper=False, fixed=0.0),
    cause="the critic started far from the returns and has not caught up",
    fix="ppo.critic_warmup_steps (train the critic alone first); ppo.value_lr; ppo.vf_coef",
)
VALUE_DIVERGENCE = FailureMode(
    name="value_divergence",
    finding="critic_weak",
    warn=Threshold("value_loss_growth", "value/loss", upper=True),  # times its start
    stop=Threshold("value_loss_max", "value/loss", upper=True),
    guard="value_divergence",
    after_warmup=True,
    cause="the critic diverges, and its loss destabilises the update",
    fix="a lower ppo.value_lr or ppo.vf_coef; keep ppo.value_clip_eps and ppo.max_grad_norm; tame the reward "
    "scale (reward.normalize, reward.clip); ppo.critic_warmup_steps",
)
ENTROPY_COLLAPSE = FailureMode(
    name="entropy_collapse",
    finding="entropy_collapse",
    warn=Threshold("entropy_floor", "policy/entropy", upper=False),  # a share of its start
    stop=Threshold("entropy_min", "policy/entropy", upper=False),
    guard="entropy_collapse",
    after_warmup=True,
    cause="the policy collapses onto a few stereotyped responses, nearly deterministic: the KL coefficient is "
    "too low and there is no entropy term, or the learning rate is too high",
    fix="raise kl.beta (or lower kl.target); a small ppo.ent_coef such as 0.01; a lower ppo.lr",
)
LENGTH_SHRINK = FailureMode(
    name="length_shrink",
    finding="length_drift",
    warn=Threshold("length_shrink", "response/length", upper=False),  # a share of its start
    stop=Threshold("length_min", "response/length", upper=False),
    guard="length_min",
    after_warmup=True,
    cause="the reward pays for brevity, or ending early became a cheap way to avoid penalties (a KL penalty "
    "paid per token)",
    fix="a reward that does not favour short or empty answers (check it by length slice); raise kl.beta",
)
LENGTH_GROWTH = FailureMode(
    name="length_growth",
    finding="length_drift",
    warn=Threshold("truncated_frac_high", "response/truncated_frac", upper=True),
    stop=Threshold("length_max", "response/length", upper=True),
    guard="length_max",
    after_warmup=True,
    cause="the reward pays for length (the classic length bias of reward models, or no cost for never "
    "ending): responses grow until they run into rollout.max_new_tokens",
    fix="reward.missing_eos_penalty; a length-neutral reward (check the pre-flight's length correlation and "
    "the reward by length slice); raise kl.beta (or rollout.max_new_tokens)",
)
# Responses that stop ending on EOS are the same mode seen from the other end: they are the ones cut at
# max_new_tokens (response/truncated_frac is 1 - response/eos_frac).
EOS_LOSS = replace(
    LENGTH_GROWTH,
    name="eos_loss",
    stop=Threshold("eos_frac_min", "response/eos_frac", upper=False),
    guard="eos_collapse",
)
CLIP_FRACTION = FailureMode(
    name="clip_fraction",
    finding="stale_batches",
    warn=Threshold("clip_frac_high", "policy/clip_frac", upper=True),
    stop=Threshold("clip_frac_max", "policy/clip_frac", upper=True),
    guard="clip_fraction",
    after_warmup=True,
    cause="the updates are too large for the trust region, so most tokens hit the clip range: each batch is "
    "over-used (too many epochs or too large a learning rate), or the data is stale",
    fix="fewer ppo.ppo_epochs; a lower ppo.lr; ppo.target_approx_kl; rollout.max_rollout_age=0",
)
POLICY_LAG = FailureMode(
    name="policy_lag",
    finding="stale_batches",
    # beyond the one version of one-step-off asynchronous rollouts
    warn=Threshold(None, "lag/policy_versions", upper=True, fixed=1.0),
    stop=Threshold("max_policy_lag", "lag/policy_versions", upper=True),
    guard="policy_lag",
    cause="the rollouts are too stale for the importance ratio to be trusted: sampled too many policy "
    "versions before the update",
    fix="a lower rollout.max_rollout_age (0, or 1 with rollout.asynchronous); fewer ppo.ppo_epochs or "
    "minibatches per rollout",
)
LENGTH_BIAS = FailureMode(
    name="length_bias",
    finding="reward_bias",
    # the pre-flight's correlation of the starting policy's scores with length, either way (|rho|)
    warn=Threshold("length_corr_high", "preflight/length_spearman", upper=True),
    cause="a scalar reward carries a length or truncation bias, and PPO moves the policy along it rather "
    "than towards better answers",
    fix="check the reward by length slice and retrain it on length-balanced pairs; reward.missing_eos_penalty "
    "for cut responses; a KL anchor strong enough (kl.beta, kl.target); watch response/length",
)
# ... and with ending on EOS: below minus the threshold, cut responses score higher
EOS_BIAS = replace(
    LENGTH_BIAS, name="eos_bias", warn=Threshold("eos_corr_high", "preflight/eos_corr", upper=False)
)

# Judged on each step's value against the stop threshold, in this order (the first crossed is reported).
BOUNDS = (
    VALUE_DIVERGENCE,
    KL_BLOWUP,
    ENTROPY_COLLAPSE,
    LENGTH_SHRINK,
    LENGTH_GROWTH,
    EOS_LOSS,
    CLIP_FRACTION,
    POLICY_LAG,
)
NONFINITE = (NONFINITE_REWARD, NONFINITE_CRITIC, NONFINITE_UPDATE)  # blamed in this order
MODES = (
    *NONFINITE,
    REWARD_HACKING,
    KL_WITHOUT_EVAL,
    REWARD_FLAT,
    CRITIC_BEHIND,
    *BOUNDS,
    LENGTH_BIAS,
    EOS_BIAS,
)


def nonfinite_mode(names: Sequence[str]) -> FailureMode:
    """The non-finite mode the metrics ``names`` (those NaN or infinite) point at: the first whose
    ``blames`` match one of them, else the update's. The guard and the diagnosis say the same."""
    return next(
        (
            mode
            for mode in NONFINITE
            if any(fnmatchcase(name, pattern) for name in names for pattern in mode.blames)
        ),
        NONFINITE_UPDATE,
    )
