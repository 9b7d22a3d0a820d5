"""The failure-mode rules: each fires on a metric history built for it and stays silent on a healthy one."""

import math

import pytest
from helpers import run_cli

from lmppo.inputs.config import DiagnosisConfig, GuardsConfig
from lmppo.runs.diagnose import RULES, LiveDiagnosis, diagnose
from lmppo.runs.failure_modes import nonfinite_mode
from lmppo.runs.guards import Guards

STEPS = 40


def healthy(step: int) -> dict:
    """A run that learns: reward and held-out score up together, KL a few nats, entropy easing, the critic
    catching up, clip fraction around 0.1, lengths steady."""
    t = step / STEPS
    record = {
        "step": step,
        "reward/rm_score": 2.0 * t + 0.05 * math.sin(step),
        "kl/ref": 4.0 * t,
        "policy/clip_frac": 0.1,
        "policy/entropy": 2.0 - 0.5 * t,
        "value/explained_var": -0.5 + t,
        "value/loss": 0.5 - 0.3 * t,
        "response/length": 10.0 + math.sin(step),
        "response/truncated_frac": 0.05,
        "lag/policy_versions": 0.0,
    }
    if step % 10 == 0:
        record["eval/gold_score"] = 1.5 + 0.5 * t
    return record


def history(**changes) -> list[dict]:
    """The healthy history with some metrics replaced by ``metric=fn(step)`` (pre-flight ones at step 0)."""
    start = {"step": 0, "eval/gold_score": 1.5}
    start.update({"preflight/samples": 64.0, "preflight/length_spearman": 0.1, "preflight/eos_corr": 0.05})
    records = [start, *(healthy(step) for step in range(1, STEPS + 1))]
    for record in records:
        for metric, value in changes.items():
            name = metric.replace("__", "/")
            if name.startswith(("eval/", "preflight/")) and name not in record:
                continue
            record[name] = value(record["step"])
    return records


CASES = {
    "over_optimisation": history(
        eval__gold_score=lambda s: 1.5 + 0.1 * min(s, 10) / 10 - 0.7 * max(s - 10, 0) / 30
    ),
    "kl_explosion": history(kl__ref=lambda s: 3.0 * s),
    "reward_flat": history(reward__rm_score=lambda s: 0.01 * math.sin(s), policy__clip_frac=lambda s: 0.0),
    "critic_weak": history(value__explained_var=lambda s: -0.8),
    "entropy_collapse": history(policy__entropy=lambda s: 2.0 * math.exp(-s / 5)),
    "length_drift": history(response__truncated_frac=lambda s: min(1.0, s / 20)),
    "stale_batches": history(policy__clip_frac=lambda s: 0.45),
    "reward_bias": history(preflight__length_spearman=lambda s: 0.8),
    "nonfinite": history(value__loss=lambda s: math.inf if s > 12 else 0.5),
}


def test_a_healthy_run_has_no_finding():
    assert diagnose(history()) == []


@pytest.mark.parametrize("rule", sorted(CASES))
def test_each_rule_fires_on_its_failure_and_names_the_evidence_and_the_fix(rule):
    findings = {finding.rule: finding for finding in diagnose(CASES[rule])}
    assert rule in findings, findings
    finding = findings[rule]
    assert finding.steps[0] <= finding.steps[1] and finding.cause and finding.fix
    assert any(char.isdigit() for char in finding.evidence)  # the numbers, not only words
    assert "." in finding.fix or "=" in finding.fix  # config keys to change


def test_every_rule_has_a_case_and_thresholds_come_from_the_config():
    assert {rule.__name__ for rule in RULES} == set(CASES)
    lenient = DiagnosisConfig(clip_frac_high=0.5)
    assert "stale_batches" not in {f.rule for f in diagnose(CASES["stale_batches"], lenient)}


def test_too_short_a_history_is_not_judged():
    assert diagnose(CASES["entropy_collapse"][:3]) == []


def test_more_failures_and_other_length_modes():
    shrinking = history(response__length=lambda s: 10.0 * math.exp(-s / 8))
    assert "length_drift" in {f.rule for f in diagnose(shrinking)}
    diverging = history(value__loss=lambda s: 0.1 * 1.2**s)
    assert "critic_weak" in {f.rule for f in diagnose(diverging)}
    no_eval = [
        {k: v for k, v in r.items() if not k.startswith("eval/")} for r in history(kl__ref=lambda s: 0.5 * s)
    ]
    found = {f.rule: f for f in diagnose(no_eval)}
    assert "over_optimisation" in found and "data.eval_prompts" in found["over_optimisation"].fix


def test_one_step_off_rollouts_are_not_stale_and_a_longer_lag_is():
    asynchronous = history(lag__policy_versions=lambda s: 1.0)  # one version behind, by design
    assert diagnose(asynchronous) == []
    found = {f.rule: f for f in diagnose(history(lag__policy_versions=lambda s: 2.0 if s > 30 else 1.0))}
    assert "stale_batches" in found and found["stale_batches"].steps == (31, STEPS)
    assert "rollout.max_rollout_age" in found["stale_batches"].fix


def test_a_reward_that_favours_cut_responses_is_a_bias_and_one_that_favours_ending_is_not():
    assert "reward_bias" in {f.rule for f in diagnose(history(preflight__eos_corr=lambda s: -0.7))}
    assert diagnose(history(preflight__eos_corr=lambda s: 0.7)) == []


def test_live_diagnosis_shows_a_rule_once_per_warn_every_steps():
    live = LiveDiagnosis(DiagnosisConfig(warn_every=10))
    shown: dict[str, list[int]] = {}
    for record in CASES["stale_batches"]:
        for finding in live.add(record["step"], record):
            shown.setdefault(finding.rule, []).append(record["step"])
    steps = shown["stale_batches"]
    assert len(steps) > 1 and all(b - a >= 10 for a, b in zip(steps, steps[1:]))
    assert "stale_batches" in {f.rule for f in live.findings()}  # the whole history, for an abort message
    silent = LiveDiagnosis(DiagnosisConfig(warn_every=None))
    assert not any(silent.add(r["step"], r) for r in CASES["stale_batches"]) and silent.findings()


def test_lmppo_diagnose_reads_a_run_directory(tmp_path, capsys):
    import json

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CASES["stale_batches"]))
    assert run_cli("diagnose", str(tmp_path)) == 0
    assert "stale_batches (steps" in capsys.readouterr().out
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history()))
    assert run_cli("diagnose", str(tmp_path)) == 0
    assert "no known failure mode" in capsys.readouterr().out


def test_a_component_rising_while_the_judge_falls_is_over_optimisation_even_if_the_sum_is_flat():
    hacked = history(
        reward__rm_score=lambda s: 1.0 + 0.01 * math.sin(s),  # the combined score hardly moves
        reward__format__raw=lambda s: 0.05 * s,  # one component climbs
        eval__gold_score=lambda s: 1.5 - 0.02 * s,
    )
    for record in hacked[1:]:
        record["reward/format/raw"] = 0.05 * record["step"]  # not in the healthy history: set it here
    found = {f.rule: f for f in diagnose(hacked)}
    assert "over_optimisation" in found and "reward/format/raw rose" in found["over_optimisation"].evidence


def test_the_guard_and_the_rule_blame_what_went_non_finite_first():
    """The nonfinite guard's message and the diagnosis name the same cause, from the metrics that broke."""
    critic = diagnose(CASES["nonfinite"])[0]
    assert critic.rule == "nonfinite" and critic.steps == (13, STEPS) and "value/loss" in critic.evidence
    assert "critic diverged" in critic.cause
    guards = Guards(GuardsConfig(nonfinite_patience=1))
    fired = guards.check(7, {"policy/loss": math.nan, "policy/grad_norm": math.nan})
    assert "the update overflowed" in fired.message and "ppo.lr" in fired.message
    assert nonfinite_mode(["reward/rm_score", "adv/mean"]).cause == "the reward produced non-finite scores"
