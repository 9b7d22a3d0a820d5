"""The embedded default, CI-sized: SFT -> RM -> PPO -> evaluation -> report on the toy world."""

import json
import re

import pytest
import yaml
from helpers import run_cli

from lmppo.interface.quickstart import run_quickstart
from lmppo.runs.diagnose import diagnose_run


@pytest.mark.slow
def test_fast_quickstart_improves_gold_score_with_an_accurate_reward_model(tmp_path):
    """Two seeds, judged on their mean: one 20-step run's gold gain depends on the CPU's float rounding
    (2026-12-01, AMD EPYC: seeds 0-3 gained +0.04, +0.43, +0.30, +0.045 gold, win rates 0.55-0.66)."""
    gains, win_rates = [], []
    for seed in (0, 1):
        summary = run_quickstart(tmp_path / f"qs{seed}", fast=True, seed=seed)
        sft, ppo = summary["policies"]["SFT"], summary["policies"]["PPO"]
        gains.append(ppo["eval/gold_score"] - sft["eval/gold_score"])
        win_rates.append(ppo["eval/win_rate"])
        assert ppo["eval/reward/rm_score"] > sft["eval/reward/rm_score"], summary
        assert ppo["eval/kl/ref"] < 10.0  # inside the configured budget
        result = json.loads((tmp_path / f"qs{seed}" / "ppo" / "quickstart.json").read_text())
        assert result["rm_accuracy"] >= 0.75
    assert sum(gains) / 2 > 0.05 and sum(win_rates) / 2 > 0.55, (gains, win_rates)
    run_dir = tmp_path / "qs0" / "ppo"
    html = (run_dir / "report" / "index.html").read_text()
    pngs = sorted(p.name for p in (run_dir / "report").glob("*.png"))
    embedded = re.findall(r"<img alt='([^']+)' src='data:image/png;base64,", html)
    assert pngs and sorted(embedded) == pngs  # every plot is in the self-contained page
    assert (run_dir / "final" / "generation_config.json").is_file()
    assert diagnose_run(run_dir) == []  # a healthy run: no failure mode in its metrics
    # PPO again on seed 0's SFT policy and RM (--models-from, as benchmarks/ablate_quickstart.py does)
    reused = run_quickstart(tmp_path / "reuse0", fast=True, seed=0, models_from=tmp_path / "qs0")
    assert reused == json.loads((run_dir / "quickstart.json").read_text())["summary"]
    assert not (tmp_path / "reuse0" / "sft").exists()  # stages 1-3 skipped


@pytest.mark.slow
def test_the_beta_0_quickstart_is_stopped_by_a_guard_and_diagnosed_as_over_optimisation(tmp_path, capsys):
    """No KL anchor: the training RM score climbs while the held-out gold score falls (the README's run),
    until a guard stops the run; its message, `lmppo diagnose` and the report say why."""
    assert run_cli("quickstart", "--beta", "0", "--out", str(tmp_path / "qs")) == 3  # a guard abort
    err = capsys.readouterr().err
    diagnosis = err[err.index("Diagnosis of the metrics so far") :]
    assert "- over_optimisation" in diagnosis and "eval/gold_score" in diagnosis
    run_dir = tmp_path / "qs" / "ppo"
    findings = {finding.rule: finding for finding in diagnose_run(run_dir)}
    assert "over_optimisation" in findings and "eval/gold_score" in findings["over_optimisation"].evidence
    assert (run_dir / "best" / "config.json").is_file() and not (run_dir / "final").exists()
    assert "over_optimisation" in (run_dir / "report" / "index.html").read_text()


@pytest.mark.slow
def test_the_tools_quickstart_trains_and_evaluates_whole_episodes(tmp_path):
    """--task tools end to end, shrunk: SFT on demonstrated episodes, no reward model (the reward is
    programmatic), PPO on episodes with the calculator, the held-out evaluation of whole episodes."""
    summary = run_quickstart(
        tmp_path / "qs", fast=True, task="tools", overrides=["sft.epochs=1", "run.steps=2"]
    )
    sft, ppo = summary["policies"]["SFT"], summary["policies"]["PPO"]
    assert summary["score"] == "reward" and sft["eval/episode/turns"] >= 1
    assert {"eval/episode/tool_calls", "eval/episode/tool_failures", "eval/reward/turn"} <= set(ppo)
    assert ppo["eval/episode/timeouts"] == 0
    assert ppo["eval/reward/total"] == pytest.approx(ppo["eval/reward/rm_score"] + ppo["eval/reward/turn"])
    run_dir = tmp_path / "qs" / "ppo"
    assert not (tmp_path / "qs" / "rm").exists() and not (run_dir / "rm_eval.json").exists()
    rows = json.loads((run_dir / "eval.json").read_text())["policies"]["PPO"]["rows"]
    assert all(row["episode"] and row["turns"] >= 1 for row in rows)  # every held-out row keeps its episode
    trained = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert sum("episode/turns" in record for record in trained) == 2
    assert json.loads((run_dir / "quickstart.json").read_text())["rm_accuracy"] is None


def test_models_from_needs_a_finished_quickstart(tmp_path, capsys):
    assert run_cli("quickstart", "--out", str(tmp_path / "qs"), "--models-from", str(tmp_path / "none")) == 2
    assert "holds no finished quickstart to reuse" in capsys.readouterr().err
    assert not (tmp_path / "qs").exists()  # nothing written


def test_train_rm_rejects_a_row_without_chosen(tmp_path, capsys):
    (tmp_path / "pairs.jsonl").write_text(json.dumps({"prompt": "hi", "rejected": "no"}) + "\n")
    config = {
        "model": {"path": str(tmp_path / "model")},
        "data": str(tmp_path / "pairs.jsonl"),
        "output_dir": str(tmp_path / "rm"),
    }
    (tmp_path / "rm.yaml").write_text(yaml.safe_dump(config))
    assert run_cli("train-rm", str(tmp_path / "rm.yaml")) == 2
    err = capsys.readouterr().err
    assert "pairs.jsonl, line 1" in err and "'chosen'" in err and "Traceback" not in err
