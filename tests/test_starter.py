"""lmppo init: a starter config that validates, runs, carries its keys' descriptions, and is sized by the
memory plan for the device."""

import json
import re
import shutil

import pytest
import yaml
from helpers import COUNT_GOOD, PROMPTS, run_cli

from lmppo.errors import LmppoError
from lmppo.inputs.config import load_config
from lmppo.inputs.resolve import check_batches
from lmppo.interface.starter import StarterAnswers, commented_yaml, sized_starter
from lmppo.modeling.loading import load_model_config
from lmppo.runs.plan import memory_plan


def answers(run_files, **changes):
    named = {
        "policy": str(run_files.parent / "policy"),
        "prompts": str(run_files.parent / "prompts.jsonl"),
        "reward_function": COUNT_GOOD,
        "output_dir": str(run_files.parent / "starter_run"),
    }
    return StarterAnswers(**{**named, **changes})


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
    assert run_cli("ppo", "mine.yaml", "run.steps=1") == 0  # as written: sized to the 8 prompts
    assert (
        run_cli("init", "mine.yaml", *flags, "--reward-function", COUNT_GOOD) == 2
    )  # exists: not overwritten
    assert run_cli("init", "other.yaml", *flags) == 2  # no reward named, no terminal to ask on
    assert run_cli("init", "other.yaml", "--reward-function", COUNT_GOOD) == 2  # no policy
    assert not (tmp_path / "other.yaml").exists()
    with pytest.raises(LmppoError, match="name exactly one reward"):
        sized_starter(answers(run_files, reward_url="http://127.0.0.1:9/score"))


def test_a_large_policy_on_a_cpu_gets_lora_for_speed(run_files, monkeypatch):
    from lmppo.interface import starter as starter_module

    monkeypatch.setattr(starter_module, "CPU_FULL_TUNING_MAX", 1000)  # the tiny policy counts as large
    starter = sized_starter(answers(run_files), device="cpu")
    assert starter.changes[0].endswith("(CPU speed)")
    assert starter.config.models.policy_lora.enabled and starter.config.ppo.lr == 1e-4
    assert "policy_lora:" in commented_yaml(starter)
    # and its critic is a head on the LoRA policy's trunk, not a second, fully trained network
    assert starter.config.models.value.mode == "shared" and "models.value.mode=shared" in starter.changes[-1]
    assert not sized_starter(
        answers(run_files), device="cuda", available=10**12
    ).config.models.policy_lora.enabled


def write_prompts(folder, count: int, column: str = "question"):
    """``count`` prompt rows with the prompt in ``column`` (and an answer beside it), as users hold them."""
    rows = (json.dumps({column: PROMPTS[i % len(PROMPTS)], "answer": "good"}) for i in range(count))
    (folder / "prompts.jsonl").write_text("\n".join(rows) + "\n")
    return folder / "prompts.jsonl"


@pytest.mark.parametrize(("prompts", "batch", "minibatch"), [(8, 8, 4), (16, 16, 16), (10_000, 32, 16)])
def test_the_starter_sizes_a_step_to_the_prompts(run_files, tmp_path, prompts, batch, minibatch):
    path = write_prompts(tmp_path, prompts)
    cfg = sized_starter(answers(run_files, prompts=str(path), prompt_key="question"), device="cpu").config
    assert (cfg.rollout.batch_size, cfg.ppo.minibatch_size) == (batch, minibatch)
    check_batches(cfg, prompts)  # what lmppo ppo checks before it loads a model


def test_a_run_refuses_its_batch_sizes_once_with_sizes_that_fix_every_problem(run_files):
    cfg = load_config(run_files, ["rollout.batch_size=32", "ppo.minibatch_size=64"])
    with pytest.raises(LmppoError) as refused:
        check_batches(cfg, 8)
    message = str(refused.value)
    assert "rollout.batch_size=32 is larger than the 8 prompts" in message
    assert "ppo.minibatch_size=64 is larger than the 32 responses of a step" in message
    assert message.endswith("set rollout.batch_size=8 ppo.minibatch_size=4, or give more prompts")
    fitted = load_config(run_files, ["rollout.batch_size=8", "ppo.minibatch_size=4"])
    check_batches(fitted, 8)


def bad_reward(run_files, tmp_path, kind: str) -> dict:
    """A reward flag for ``lmppo init`` that cannot score: the kinds a newcomer gets wrong."""
    (tmp_path / "rewards.py").write_text(
        "def raises(prompts, responses):\n    raise KeyError('answer')\n"
        "def nan(prompts, responses):\n    return [float('nan')] * len(responses)\n"
    )
    if kind == "causal LM":
        return {"--reward-model": str(run_files.parent / "policy")}
    if kind == "dead URL":
        return {"--reward-url": "http://127.0.0.1:9/score"}
    return {"--reward-function": f"{tmp_path / 'rewards.py'}:{kind}"}


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("nope", "has no attribute 'nope'"),
        ("raises", "raised KeyError: 'answer'"),
        ("nan", "scored 2 of 2 responses with a non-finite value"),
        ("causal LM", "is a causal language model (LlamaForCausalLM), not a reward model"),
        ("dead URL", "did not answer"),
    ],
)
def test_init_tries_the_reward_and_writes_nothing_when_it_cannot_score(
    run_files, tmp_path, monkeypatch, capsys, kind, message
):
    monkeypatch.setattr("lmppo.rewards.remote_reward.FIRST_PAUSE_S", 0.01)
    flags = [item for pair in bad_reward(run_files, tmp_path, kind).items() for item in pair]
    policy, prompts = str(run_files.parent / "policy"), str(run_files.parent / "prompts.jsonl")
    assert run_cli("init", str(tmp_path / "mine.yaml"), "--policy", policy, "--prompts", prompts, *flags) == 2
    assert message in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "mine.yaml").exists()


def test_init_names_its_own_flag_for_a_missing_column(run_files, tmp_path, capsys):
    path = write_prompts(tmp_path, 8, column="question")
    policy = str(run_files.parent / "policy")
    args = ["init", str(tmp_path / "mine.yaml"), "--policy", policy, "--prompts", str(path)]
    assert run_cli(*args, "--reward-function", COUNT_GOOD) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "or --prompt-key naming the column" in err and "data.prompt_key" not in err


def test_init_writes_absolute_paths_so_the_config_runs_from_any_folder(run_files, tmp_path, monkeypatch):
    project = tmp_path / "newcomer"
    project.mkdir()
    shutil.copytree(run_files.parent / "policy", project / "sft")
    write_prompts(project, 8)
    (project / "my_rewards.py").write_text(
        "def score(prompts, responses):\n    return [1.0] * len(responses)\n"
    )
    monkeypatch.chdir(project)
    flags = ["--policy", "sft", "--prompts", "prompts.jsonl", "--prompt-key", "question"]
    assert run_cli("init", "my.yaml", *flags, "--reward-function", "my_rewards.py:score") == 0
    written = yaml.safe_load((project / "my.yaml").read_text())
    assert written["models"]["policy"]["path"] == str(project / "sft")
    assert written["reward"]["function"] == f"{project / 'my_rewards.py'}:score"
    assert written["run"]["output_dir"] == str(project / "runs" / "my_run")
    monkeypatch.chdir(tmp_path)  # the parent folder, as in `lmppo ppo newcomer/my.yaml`
    assert run_cli("ppo", "newcomer/my.yaml", "run.steps=1") == 0
    assert (project / "runs" / "my_run" / "final").is_dir()


def test_a_relative_path_that_is_missing_names_the_folder_it_was_read_from(run_files, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        LmppoError,
        match=re.escape(
            f"model path 'sft' does not exist in {tmp_path} (a relative path is read from the working"
        ),
    ):
        load_model_config("sft")
