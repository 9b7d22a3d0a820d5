"""A new user's first hour as a script (issue 49): ``lmppo init`` on their own policy, prompt file and reward,
then plan, ppo, report, diagnose, eval and resume, with no edit to the config it wrote; and each starter a
new user brings (a tiny policy or SmolLM2's GGUF file; a reward function, model or server; 8, 16 or
10,000 prompts) trains a step as written."""

import json
import shutil

import pytest
import yaml
from helpers import (
    PROMPTS,
    REWARD_SPECIALS,
    REWARD_TEMPLATE,
    WORDS,
    build_tokenizer,
    fake_server,
    llama_config,
    run_cli,
    serving,
)
from transformers import LlamaForSequenceClassification

from lmppo.training.metrics import read_metrics

REWARDS = "def score(prompts, responses):\n    return [float(r.split().count('good')) for r in responses]\n"


def newcomer(tmp_path, run_files, prompts: int = 16):
    """The folder a new user starts from: their SFT policy, a prompt file whose column is `question`
    (with an answer column beside it) and a reward function in a file of their own."""
    folder = tmp_path / "newcomer"
    folder.mkdir()
    shutil.copytree(run_files.parent / "policy", folder / "sft")
    rows = (json.dumps({"question": PROMPTS[i % len(PROMPTS)], "answer": "good"}) for i in range(prompts))
    (folder / "prompts.jsonl").write_text("\n".join(rows) + "\n")
    (folder / "my_rewards.py").write_text(REWARDS)
    return folder


def init(*reward: str) -> int:
    """``lmppo init my.yaml`` as the README says, in the newcomer's folder."""
    return run_cli(
        "init",
        "my.yaml",
        "--policy",
        "sft",
        "--prompts",
        "prompts.jsonl",
        "--prompt-key",
        "question",
        *reward,
    )


def test_the_first_hour_works_the_first_time_with_no_edit(run_files, tmp_path, monkeypatch, capsys):
    folder = newcomer(tmp_path, run_files)
    monkeypatch.chdir(folder)
    assert init("--reward-function", "my_rewards.py:score") == 0
    assert run_cli("plan", "my.yaml") == 0 and "fits" in capsys.readouterr().out
    monkeypatch.chdir(tmp_path)  # from the parent folder: the config's paths still hold
    run_dir = folder / "runs" / "my_run"
    assert run_cli("ppo", "newcomer/my.yaml", "run.steps=2") == 0
    out = capsys.readouterr().out
    assert "loading the policy" in out and "reward pre-flight on 16 samples" in out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all(len(line) <= 80 and "ETA" in line for line in steps)
    assert steps[0].split()[2] == "reward"  # a reward function's score is "reward", not "rm"
    assert f"done: the trained policy is in {run_dir / 'final'}" in out

    assert run_cli("report", str(run_dir)) == 0 and (run_dir / "report" / "index.html").is_file()
    assert run_cli("diagnose", str(run_dir)) == 0
    assert run_cli("eval", str(run_dir), "--prompts", str(folder / "prompts.jsonl")) == 0
    assert "reward" in capsys.readouterr().out  # the held-out table, in the reward's words

    assert run_cli("ppo", "--resume", str(run_dir), "run.steps=3") == 0
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2, 3]
    capsys.readouterr()
    assert run_cli("ppo", "--resume", str(run_dir), "run.steps=3") == 0  # finished: says so
    assert "nothing to do" in capsys.readouterr().err
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2, 3]


GUESS_ENVIRONMENT = """
from lmppo.sampling.environments import Step


class Guess:
    \"\"\"The user thinks of the row's answer; the policy has guesses until it says it.\"\"\"

    def reset(self, row, seed):
        self.answer = row["answer"]

    def step(self, text):
        if self.answer in text.split():
            return Step(reward=1.0, done=True)
        return Step(messages=[{"role": "user", "content": "no , guess again ."}], reward=-0.1)
"""


def test_an_agent_users_first_hour_works_with_no_edit_and_no_reward_function(
    run_files, tmp_path, monkeypatch, capsys
):
    """init --environment on 16 prompts, then plan, ppo, report, eval and resume: the environment's rewards are
    the run's, shown on the step line, and the episode budget fits the policy's 128-token window."""
    folder = newcomer(tmp_path, run_files)
    (folder / "my_env.py").write_text(GUESS_ENVIRONMENT)
    monkeypatch.chdir(folder)
    assert init("--environment", "my_env.py:Guess") == 0
    written = yaml.safe_load((folder / "my.yaml").read_text())
    assert "reward" not in written and written["rollout"]["environment"].endswith("my_env.py:Guess")
    assert written["rollout"]["max_total_tokens"] < 128 and written["rollout"]["max_turns"] >= 1
    assert run_cli("plan", "my.yaml") == 0 and "fits" in capsys.readouterr().out
    run_dir = folder / "runs" / "my_run"
    assert run_cli("ppo", "my.yaml", "run.steps=2") == 0
    steps = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and steps[0].split()[2] == "reward" and float(steps[0].split()[3]) != 0
    assert run_cli("report", str(run_dir)) == 0 and (run_dir / "report" / "index.html").is_file()
    assert run_cli("eval", str(run_dir), "--prompts", str(folder / "prompts.jsonl")) == 0
    assert run_cli("ppo", "--resume", str(run_dir), "run.steps=3") == 0
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2, 3]
    assert all(r["reward/turn"] != 0 for r in read_metrics(run_dir)[1:])


def test_init_refuses_an_environment_that_fails_on_the_prompt_rows_writing_nothing(
    run_files, tmp_path, monkeypatch, capsys
):
    folder = newcomer(tmp_path, run_files)
    (folder / "my_env.py").write_text(GUESS_ENVIRONMENT.replace('row["answer"]', 'row["secret"]'))
    monkeypatch.chdir(folder)
    assert init("--environment", "my_env.py:Guess") == 2
    err = capsys.readouterr().err
    assert "KeyError" in err and "'secret'" in err and "reset it on the first 2 prompt rows" in err
    assert not (folder / "my.yaml").exists()


def reward_model(folder):
    """A reward model with its own tokenizer (another vocabulary than the policy's) and template."""
    tokenizer = build_tokenizer(
        REWARD_SPECIALS, WORDS, pad="[PAD]", eos="[EOS]", chat_template=REWARD_TEMPLATE
    )
    model = LlamaForSequenceClassification(llama_config(tokenizer, num_labels=1))
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder / "rm")
    tokenizer.save_pretrained(folder / "rm")
    return "--reward-model", "rm"


@pytest.mark.parametrize(
    ("reward", "prompts", "batch"), [("function", 8, 8), ("model", 16, 16), ("url", 10_000, 32)]
)
def test_each_starter_trains_a_step_as_written(run_files, tmp_path, monkeypatch, reward, prompts, batch):
    folder = newcomer(tmp_path, run_files, prompts)
    monkeypatch.chdir(folder)
    flags = {
        "function": lambda: ("--reward-function", "my_rewards.py:score"),
        "model": lambda: reward_model(folder),
        "url": lambda: ("--reward-url", serving(fake_server([]))),
    }[reward]()
    assert init(*flags) == 0
    assert yaml.safe_load((folder / "my.yaml").read_text())["rollout"]["batch_size"] == batch
    assert run_cli("ppo", "my.yaml", "run.steps=1") == 0
    assert [r["step"] for r in read_metrics(folder / "runs" / "my_run")] == [0, 1]


@pytest.mark.slow
def test_smollm2_from_its_gguf_file_trains_a_step_as_written(tmp_path, monkeypatch, capsys):
    """The one real chat model, as a newcomer has it: a .gguf file. init picks LoRA and a critic on its
    trunk for a CPU, and the first step runs as written."""
    from test_smollm2 import smollm2_gguf

    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"question": p}) + "\n" for p in PROMPTS * 2))
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    flags = [
        "--prompts",
        "prompts.jsonl",
        "--prompt-key",
        "question",
        "--reward-function",
        "my_rewards.py:score",
    ]
    assert run_cli("init", "my.yaml", "--policy", str(smollm2_gguf()), *flags) == 0
    written = (tmp_path / "my.yaml").read_text()
    assert "policy_lora:" in written and "mode: shared" in written and "batch_size: 8" in written
    assert run_cli("ppo", "my.yaml", "run.steps=1") == 0
    assert "step 1/1" in capsys.readouterr().out
    assert (tmp_path / "runs" / "my_run" / "final" / "config.json").is_file()
