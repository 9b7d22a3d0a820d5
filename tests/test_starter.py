"""lmppo init: a starter config that validates, runs, carries its keys' descriptions, and is sized by the
memory plan for the device."""

import pytest
import yaml
from helpers import COUNT_GOOD, run_cli

from lmppo.config import load_config
from lmppo.errors import LmppoError
from lmppo.plan import memory_plan
from lmppo.starter import StarterAnswers, commented_yaml, sized_starter


def answers(run_files, **changes):
    return StarterAnswers(
        policy=str(run_files.parent / "policy"),
        prompts=str(run_files.parent / "prompts.jsonl"),
        reward_function=COUNT_GOOD,
        output_dir=str(run_files.parent / "starter_run"),
        **changes,
    )


def test_the_starter_fits_as_it_is_and_reads_back_as_the_same_config_with_comments(run_files, tmp_path):
    starter = sized_starter(answers(run_files), device="cpu")
    assert starter.fits and not starter.changes
    text = commented_yaml(starter)
    assert "  lr: 1.0e-05  # the policy's AdamW learning rate" in text
    assert "needs" in text.splitlines()[1]  # the plan's verdict in the header
    (tmp_path / "starter.yaml").write_text(text)
    assert load_config(tmp_path / "starter.yaml") == starter.config


def test_a_starter_too_large_for_the_device_takes_the_plans_remedies_until_it_fits(run_files, tmp_path):
    default = sized_starter(answers(run_files), device="cpu").config
    needed = memory_plan(default, device="cpu", available=10**12).needed_per_rank
    starter = sized_starter(answers(run_files), device="cpu", available=int(needed * 0.85))
    assert starter.changes and starter.fits, starter.summary
    assert starter.changes[0] == "ppo.advantage=reinforce_pp"  # the seeds' ladder: drop the critic first
    (tmp_path / "starter.yaml").write_text(commented_yaml(starter))
    assert yaml.safe_load((tmp_path / "starter.yaml").read_text())["ppo"]["advantage"] == "reinforce_pp"


def test_lmppo_init_writes_a_config_that_runs_and_refuses_what_it_cannot_do(run_files, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    flags = [
        "--policy",
        str(run_files.parent / "policy"),
        "--prompts",
        str(run_files.parent / "prompts.jsonl"),
    ]
    assert run_cli("init", "mine.yaml", *flags, "--reward-function", COUNT_GOOD, "--run-dir", "runs/r") == 0
    assert run_cli("ppo", "mine.yaml", "run.steps=1", "rollout.batch_size=4", "ppo.minibatch_size=4") == 0
    assert (
        run_cli("init", "mine.yaml", *flags, "--reward-function", COUNT_GOOD) == 2
    )  # exists: not overwritten
    assert run_cli("init", "other.yaml", *flags) == 2  # no reward named, no terminal to ask on
    assert run_cli("init", "other.yaml", "--reward-function", COUNT_GOOD) == 2  # no policy
    assert not (tmp_path / "other.yaml").exists()
    with pytest.raises(LmppoError, match="name exactly one reward"):
        sized_starter(answers(run_files, reward_url="http://127.0.0.1:9/score"))


def test_a_large_policy_on_a_cpu_gets_lora_for_speed(run_files, monkeypatch):
    from lmppo import starter as starter_module

    monkeypatch.setattr(starter_module, "CPU_FULL_TUNING_MAX", 1000)  # the tiny policy counts as large
    starter = sized_starter(answers(run_files), device="cpu")
    assert starter.changes[0].endswith("(CPU speed)")
    assert starter.config.models.policy_lora.enabled and starter.config.ppo.lr == 1e-4
    assert "policy_lora:" in commented_yaml(starter)
    assert not sized_starter(
        answers(run_files), device="cuda", available=10**12
    ).config.models.policy_lora.enabled
