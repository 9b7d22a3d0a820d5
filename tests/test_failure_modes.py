"""The table of failure modes is read whole: its config keys exist, every rule of the guards and of the
diagnosis comes from a row, and every mode a guard stops a run on is one the diagnosis explains."""

import math
from pathlib import Path

import pytest
from test_diagnose import history

from lmppo.inputs.config import DiagnosisConfig, GuardsConfig
from lmppo.runs.diagnose import RULES, diagnose
from lmppo.runs.failure_modes import BOUNDS, MODES, NONFINITE, nonfinite_mode
from lmppo.runs.guards import Guards

STOPPED = [mode for mode in MODES if mode.stop is not None]
METRICS_DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def test_every_threshold_names_a_config_key_or_is_fixed():
    for mode in MODES:
        assert (mode.warn.key is None) != (mode.warn.fixed is None), mode.name
        assert mode.warn.key is None or mode.warn.key in DiagnosisConfig.model_fields, mode.name
        if mode.stop is not None:
            assert mode.stop.key in GuardsConfig.model_fields and mode.stop.fixed is None, mode.name
        assert (mode.stop is None) == (mode.guard is None), mode.name
        assert mode.cause and mode.fix, mode.name


def test_every_rule_of_both_judges_is_some_rows():
    assert len({mode.name for mode in MODES}) == len(MODES)
    assert set(BOUNDS) | set(NONFINITE) <= set(MODES)
    assert {mode.finding for mode in MODES} == {rule.__name__ for rule in RULES}
    guard_rules = {mode.guard for mode in BOUNDS} | {"nonfinite", "reward_without_eval"}
    assert {mode.guard for mode in STOPPED} == guard_rules


def test_every_guard_key_is_some_rows():
    """No GuardsConfig threshold outside the table (``enabled`` and ``warmup_steps`` are the guards' own)."""
    keys = {mode.stop.key for mode in STOPPED} | {"enabled", "warmup_steps"}
    assert keys == set(GuardsConfig.model_fields)


def _ramp(start: float, end: float, steps: int):
    """A metric moving from ``start`` at step 1 to ``end`` at step ``steps``, then staying there."""
    return lambda s: start + (end - start) * min(max(s - 1, 0), steps - 1) / (steps - 1)


# a history per stopped mode that trips its guard, and the guard thresholds it takes (the defaults else)
TRIPS = {
    "nonfinite_reward": ({}, history(reward__rm_score=lambda s: math.nan if s > 12 else 0.1 * s)),
    "nonfinite_critic": ({}, history(value__loss=lambda s: math.inf if s > 12 else 0.5)),
    "nonfinite_update": ({}, history(policy__grad_norm=lambda s: math.nan if s > 12 else 1.0)),
    "reward_hacking": (
        {},
        history(eval__gold_score=lambda s: 1.5 + 0.1 * min(s, 10) / 10 - 0.7 * max(s - 10, 0) / 30),
    ),
    "kl_blowup": ({}, history(kl__ref=lambda s: 3.0 * s)),
    "value_divergence": ({}, history(value__loss=lambda s: 0.5 * 1.5**s)),
    "entropy_collapse": ({}, history(policy__entropy=lambda s: 2.0 * math.exp(-s / 5))),
    "length_shrink": ({"length_min": 2.0}, history(response__length=lambda s: 10.0 * math.exp(-s / 8))),
    "length_growth": (
        {"length_max": 40.0},  # responses grow into max_new_tokens (48) and are cut there
        history(response__length=_ramp(10, 48, 30), response__truncated_frac=_ramp(0.05, 1.0, 30)),
    ),
    "eos_loss": (
        {"eos_frac_min": 0.5},
        history(response__eos_frac=_ramp(0.95, 0.0, 10), response__truncated_frac=_ramp(0.05, 1.0, 10)),
    ),
    "clip_fraction": ({"clip_frac_max": 0.4}, history(policy__clip_frac=lambda s: 0.45)),
    "policy_lag": ({"max_policy_lag": 1}, history(lag__policy_versions=lambda s: 2.0 if s > 8 else 1.0)),
}


def test_every_stopped_mode_has_a_history_that_trips_its_guard():
    assert set(TRIPS) == {mode.name for mode in STOPPED}


@pytest.mark.parametrize("mode", STOPPED, ids=lambda mode: mode.name)
def test_a_mode_the_guards_stop_is_one_the_diagnosis_explains(mode):
    """Run the guards over the history until one fires: it is the mode's guard, and the diagnosis of the
    metrics so far (what the abort message shows) names the same mode, in the same words."""
    thresholds, records = TRIPS[mode.name]
    guards = Guards(GuardsConfig(**thresholds))
    guards.start(records[0])
    fired = next((r["step"], v) for r in records[1:] if (v := guards.check(r["step"], r)) is not None)
    step, violation = fired
    assert violation.rule == mode.guard and mode.cause in violation.message and mode.fix in violation.message
    found = {finding.rule: finding for finding in diagnose(records[: step + 1])}
    assert mode.finding in found, (step, found)
    assert (found[mode.finding].cause, found[mode.finding].fix) == (mode.cause, mode.fix)


def test_where_non_finite_values_start_names_the_mode():
    assert nonfinite_mode(["adv/mean", "reward/format/raw"]).name == "nonfinite_reward"
    assert nonfinite_mode(["value/loss", "policy/loss"]).name == "nonfinite_critic"
    assert nonfinite_mode(["policy/grad_norm"]).name == nonfinite_mode([]).name == "nonfinite_update"


def test_every_mode_is_in_the_table_of_docs_metrics_md():
    table = METRICS_DOC.read_text().split("## Failure modes", 1)[1].split("\n## ", 1)[0]
    assert [mode.name for mode in MODES if f"`{mode.name}`" not in table] == []
