"""A run whose reward is its environment's alone: no reward section, and the reward it shows is what it
optimises (``reward/total``: the final score, here 0, plus the environment's turn rewards)."""

from __future__ import annotations

import json

import pytest
import yaml
from helpers import run_cli
from sample_environments import SPEC


@pytest.mark.slow
def test_a_run_rewarded_by_its_environment_alone_needs_no_reward_section(run_files, tmp_path, capsys):
    config = yaml.safe_load(run_files.read_text())
    del config["reward"]
    # a near-uniform policy: long turns, so that some end with EOS and the environment answers and rewards
    config["rollout"] |= {"environment": SPEC, "max_turns": 3, "max_new_tokens": 48, "max_total_tokens": 100}
    config["diagnosis"] = {"preflight_batches": 1}
    run_files.write_text(yaml.safe_dump(config))
    assert run_cli("ppo", str(run_files)) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if "reward/total" in record]
    assert len(steps) == 2 and all(record["reward/rm_score"] == 0 for record in steps)
    assert all(record["reward/total"] == pytest.approx(record["reward/turn"]) for record in steps)
    assert max(record["reward/total"] for record in steps) > 0
    out = capsys.readouterr().out
    assert f"step 2/2  reward {steps[-1]['reward/total']:.3g}" in out
    assert "pre-flight on 4 samples of the starting policy: reward" in out
    assert records[0]["preflight/total_reward_mean"] > 0 and records[0]["preflight/rm_score_mean"] == 0
