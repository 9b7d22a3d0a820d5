import json
import math
from types import SimpleNamespace

import pytest

from lmppo.inputs.config import GuardsConfig
from lmppo.runs.failure_modes import BOUNDS
from lmppo.runs.guards import Guards

HEALTHY = {
    "reward/rm_score": 0.3,
    "kl/ref": 2.0,
    "value/loss": 0.5,
    "policy/entropy": 1.5,
    "policy/clip_frac": 0.1,
    "response/length": 20.0,
    "response/eos_frac": 0.95,
    "lag/policy_versions": 0.0,
    "health/nonfinite": 0.0,
}


def _cfg(**fields):
    """Every rule off except nonfinite, no warm-up; ``fields`` turn rules on."""
    base = dict(
        enabled=True,
        nonfinite_patience=3,
        warmup_steps=0,
        reward_without_eval_patience=None,
        **{bound.stop.key: None for bound in BOUNDS},
    )
    return SimpleNamespace(**(base | fields))


# (config field, threshold, metric, failing value, rule)
FAILURES = [
    ("value_loss_max", 10.0, "value/loss", 50.0, "value_divergence"),
    ("kl_max", 5.0, "kl/ref", 8.0, "kl_budget"),
    ("entropy_min", 0.1, "policy/entropy", 0.01, "entropy_collapse"),
    ("length_min", 4.0, "response/length", 1.0, "length_min"),
    ("length_max", 40.0, "response/length", 100.0, "length_max"),
    ("eos_frac_min", 0.5, "response/eos_frac", 0.1, "eos_collapse"),
    ("clip_frac_max", 0.3, "policy/clip_frac", 0.6, "clip_fraction"),
    ("max_policy_lag", 2, "lag/policy_versions", 5.0, "policy_lag"),
]


def test_every_threshold_rule_is_covered():
    assert {f[0] for f in FAILURES} == {bound.stop.key for bound in BOUNDS}


@pytest.mark.parametrize("field,threshold,metric,bad,rule", FAILURES)
def test_each_rule_fires_on_its_failure_and_stays_quiet_when_healthy(field, threshold, metric, bad, rule):
    guards = Guards(_cfg(**{field: threshold}))
    assert guards.check(1, HEALTHY) is None
    violation = guards.check(2, HEALTHY | {metric: bad})
    assert (violation.rule, violation.value, violation.threshold) == (rule, bad, threshold)
    for part in [rule, "step 2", metric, f"guards.{field}", f"{bad:.4g}", f"{threshold:.4g}", "Likely:"]:
        assert part in violation.message
    assert str(violation) == violation.message


@pytest.mark.parametrize("field,threshold,metric,bad,rule", FAILURES)
def test_a_rule_set_to_none_is_off(field, threshold, metric, bad, rule):
    assert Guards(_cfg()).check(2, HEALTHY | {metric: bad}) is None


def test_warmup_delays_rate_and_length_rules_but_not_the_kl_budget():
    guards = Guards(_cfg(warmup_steps=3, clip_frac_max=0.3, length_max=40.0, kl_max=5.0))
    noisy_start = HEALTHY | {"policy/clip_frac": 0.9, "response/length": 100.0}
    assert all(guards.check(step, noisy_start) is None for step in (1, 2, 3))
    assert guards.check(4, noisy_start).rule == "length_max"
    assert guards.check(1, HEALTHY | {"kl/ref": 9.0}).rule == "kl_budget"


def test_nonfinite_needs_patience_consecutive_steps():
    guards = Guards(_cfg(value_loss_max=10.0))
    nan_loss = HEALTHY | {"value/loss": math.nan}
    assert guards.check(1, nan_loss) is None  # not a value divergence: non-finite is its own rule
    assert guards.check(2, HEALTHY | {"health/nonfinite": 4.0}) is None
    assert guards.check(3, HEALTHY) is None  # a clean step resets the count
    assert guards.check(4, nan_loss) is None
    assert guards.check(5, nan_loss) is None
    violation = guards.check(6, HEALTHY | {"value/loss": math.inf, "adv/std": math.nan})
    assert (violation.rule, violation.value, violation.threshold) == ("nonfinite", 3.0, 3.0)
    assert "adv/std, value/loss" in violation.message and "guards.nonfinite_patience" in violation.message


def _eval_step(rm, heldout, key="eval/gold_score"):
    return HEALTHY | {"reward/rm_score": rm, key: heldout}


def test_reward_rising_without_held_out_improvement_fires():
    guards = Guards(_cfg(reward_without_eval_patience=2))
    assert guards.check(1, _eval_step(0.1, 0.50)) is None
    assert guards.check(2, _eval_step(0.6, 0.49)) is None  # only one interval so far
    assert guards.check(3, HEALTHY | {"reward/rm_score": 0.8}) is None
    violation = guards.check(4, _eval_step(0.9, 0.50))
    assert violation.rule == "reward_without_eval" and violation.value == pytest.approx(0.0)
    # the RM side is the mean score since the previous eval, (0.8 + 0.9) / 2 - 0.1; its noise is twice the
    # standard error of that mean (0.05), the first window's being a single step
    assert "rose by 0.75 (beyond its noise, 0.1)" in violation.message
    assert "guards.reward_without_eval_patience" in violation.message


def test_a_rise_within_the_noise_of_a_plateau_is_quiet():
    """Training scores that swing by ±0.3 from step to step: a window mean 0.1 higher is noise, not hacking."""
    guards = Guards(_cfg(reward_without_eval_patience=1))
    for step, rm in enumerate([0.2, 0.8, 0.2], start=1):
        assert guards.check(step, HEALTHY | {"reward/rm_score": rm}) is None
    assert guards.check(4, _eval_step(0.8, 0.5)) is None  # window mean 0.5, standard error 0.17
    assert guards.check(5, HEALTHY | {"reward/rm_score": 0.3}) is None
    assert guards.check(6, _eval_step(0.9, 0.5)) is None  # mean 0.6 (error 0.3): rose by 0.1 < 2 x 0.35
    assert guards.check(7, HEALTHY | {"reward/rm_score": 1.4}) is None
    # mean 1.45 (error 0.05): rose by 0.85 > 2 x 0.3
    assert guards.check(8, _eval_step(1.5, 0.5)).rule == "reward_without_eval"


def test_reward_rising_with_held_out_improvement_is_quiet():
    guards = Guards(_cfg(reward_without_eval_patience=2))
    for step, (rm, gold) in enumerate([(0.1, 0.5), (0.5, 0.5), (0.9, 0.52)], start=1):
        assert guards.check(step, _eval_step(rm, gold)) is None


def test_the_starting_policys_evaluation_is_the_first_held_out_score():
    """Step 0's evaluation (paired with step 1's training score, sampled from the same policy) starts the
    window: with patience 1 the first evaluation after it can already fire."""
    guards = Guards(_cfg(reward_without_eval_patience=1))
    guards.start({"eval/gold_score": 0.5, "preflight/samples": 64.0})
    assert guards.state_dict()["baseline"] == 0.5
    rm_scores = [0.1, 0.7, 0.7]  # then 0.7 at step 4 with an evaluation: mean 0.55, standard error 0.15
    assert all(
        guards.check(step, HEALTHY | {"reward/rm_score": rm}) is None for step, rm in enumerate(rm_scores, 1)
    )
    violation = guards.check(4, _eval_step(0.7, 0.45))
    assert violation.rule == "reward_without_eval" and "never beat 0.5 " in violation.message
    quiet = Guards(_cfg(reward_without_eval_patience=1))
    quiet.start({"preflight/samples": 64.0})  # no evaluation at step 0: nothing to compare against
    assert all(
        quiet.check(step, HEALTHY | {"reward/rm_score": rm}) is None for step, rm in enumerate(rm_scores, 1)
    )
    assert quiet.check(4, _eval_step(0.7, 0.45)) is None


def test_held_out_rm_score_is_used_without_a_gold_judge():
    guards = Guards(_cfg(reward_without_eval_patience=1))
    assert guards.check(1, _eval_step(0.1, 0.3, key="eval/reward/rm_score")) is None
    assert guards.check(2, _eval_step(0.5, 0.2, key="eval/reward/rm_score")).rule == "reward_without_eval"


def test_state_round_trips_through_json():
    cfg = _cfg(reward_without_eval_patience=2)
    guards = Guards(cfg)
    guards.check(1, _eval_step(0.1, 0.5))
    guards.check(2, _eval_step(0.5, 0.5))
    guards.check(3, HEALTHY | {"health/nonfinite": 1.0, "reward/rm_score": 0.9})
    guards.check(4, HEALTHY | {"health/nonfinite": 1.0, "reward/rm_score": 0.9})

    resumed = Guards(cfg)
    resumed.load_state_dict(json.loads(json.dumps(guards.state_dict())))
    assert resumed.state_dict() == guards.state_dict()
    assert resumed.check(5, HEALTHY | {"health/nonfinite": 1.0}).rule == "nonfinite"  # the streak went on
    resumed.load_state_dict(guards.state_dict())
    assert resumed.check(5, _eval_step(0.9, 0.5)).rule == "reward_without_eval"  # so did the eval history


def test_a_checkpoint_from_before_the_noise_aware_rule_resumes():
    """Old checkpoints kept (mean, held-out) pairs and no sum of squares: their windows count as noiseless."""
    guards = Guards(_cfg(reward_without_eval_patience=1))
    guards.load_state_dict(
        {"nonfinite_streak": 0, "evals": [[0.1, 0.5]], "rm_sum": 0.6, "rm_count": 2, "baseline": None}
    )
    assert guards.state_dict()["evals"] == [[0.1, 0.0, 0.5]]
    assert guards.state_dict()["rm_sq_sum"] == pytest.approx(0.18)  # as if both steps scored 0.3
    assert guards.check(3, _eval_step(0.3, 0.5)).rule == "reward_without_eval"  # rose by 0.2, no noise


def test_disabled_guards_never_fire():
    guards = Guards(_cfg(enabled=False, kl_max=1.0, nonfinite_patience=1))
    assert guards.check(10, HEALTHY | {"kl/ref": 100.0, "value/loss": math.nan}) is None


def test_the_default_config_accepts_a_healthy_run():
    guards = Guards(GuardsConfig())
    assert all(guards.check(step, HEALTHY) is None for step in range(1, 20))


def test_a_step_breaking_a_rule_in_warm_up_is_not_healthy():
    guards = Guards(_cfg(value_loss_max=10.0, warmup_steps=5))
    assert guards.check(1, {"value/loss": 3.6e9}) is None  # warm-up: no abort
    assert not guards.healthy  # but its checkpoint is not a "last known good" one
    guards.check(2, {"value/loss": 1.0})
    assert guards.healthy
    guards.check(3, {"value/loss": math.nan})
    assert not guards.healthy
