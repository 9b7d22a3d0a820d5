"""A whole run (lmppo.runs.run): exact resume, guard aborts keeping the last good checkpoint,
SIGTERM/SIGKILL."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml
from helpers import COUNT_GOOD, GOOD_JUDGE, PROMPTS, comparable, run_cli, write_config
from sample_environments import SPEC as EPISODES
from transformers import AutoModelForCausalLM

from lmppo.inputs.config import load_config
from lmppo.inputs.resolve import resolve
from lmppo.runs.checkpoint import (
    best_checkpoint,
    last_good_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    unflatten_state,
)
from lmppo.runs.run import numerics_line, ptx_batches
from lmppo.training.metrics import read_metrics


def test_ptx_batches_are_a_seeded_stream_of_demonstrations_per_rank(run_files, policy_tokenizer):
    demos = run_files.parent / "demos.jsonl"
    words = ["cat", "dog", "sun", "rain", "tree", "bird", "red", "blue"]
    demos.write_text(
        "".join(json.dumps({"prompt": f"tell me about the {w}", "response": w}) + "\n" for w in words)
    )
    assert ptx_batches(load_config(run_files), policy_tokenizer, "cpu") is None  # ppo.ptx_coef is 0
    cfg = load_config(
        run_files, [f"data.ptx_demonstrations={demos}", "ppo.ptx_coef=0.5", "ppo.ptx_batch_size=3"]
    )

    def draws(rank: int) -> list[torch.Tensor]:
        stream = ptx_batches(cfg, policy_tokenizer, "cpu", rank)
        return [stream()["input_ids"] for _ in range(3)]

    first, again, other_rank = draws(0), draws(0), draws(1)
    assert (
        first[0].shape[0] == 3 and (first[0] == policy_tokenizer.eos_token_id).any()
    )  # responses end with EOS
    assert all(torch.equal(a, b) for a, b in zip(first, again))  # the same seed, the same stream
    assert not all(torch.equal(a, b) for a, b in zip(first, other_rank))  # each rank its own demonstrations


def test_resume_before_the_first_checkpoint_says_so(tmp_path, capsys):
    (tmp_path / "run").mkdir()  # killed while loading models: no config.yaml, no checkpoint yet
    assert run_cli("ppo", "--resume", str(tmp_path / "run")) == 2
    err = capsys.readouterr().err
    assert "holds no checkpoint yet" in err and "start the run again" in err and "Traceback" not in err


def test_a_run_whose_config_yaml_was_deleted_says_so_and_restores_it_from_the_checkpoint(run_files, capsys):
    run_dir = run_files.parent / "run"
    assert run_cli("ppo", str(write_config(run_files, run={"steps": 1}))) == 0
    (run_dir / "config.yaml").unlink()
    capsys.readouterr()
    assert run_cli("ppo", "--resume", str(run_dir), "run.steps=2") == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "config.yaml is missing" in err and "step-000001" in err and "--restore-config" in err
    assert "holds no checkpoint yet" not in err
    with pytest.warns(
        UserWarning, match=r"restored .*config.yaml from the manifest of checkpoint step-000001"
    ):
        assert run_cli("ppo", "--resume", str(run_dir), "--restore-config", "run.steps=2") == 0
    assert (run_dir / "config.yaml").is_file()
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2]


def test_an_output_dir_that_is_a_file_is_refused_and_left_alone(run_files, capsys):
    target = run_files.parent / "taken"
    target.write_text("my notes")
    assert run_cli("ppo", str(run_files), f"run.output_dir={target}") == 2
    assert "is an existing file" in capsys.readouterr().err and target.read_text() == "my notes"


def policy_tensors(run_dir):
    return load_checkpoint(latest_checkpoint(run_dir)).tensors["policy"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "lora, sections",
    [
        (False, {}),
        (True, {}),
        (True, {"ppo": {"gradient_checkpointing": True, "critic_warmup_steps": 3}}),
        (False, {"run": {"precision": "bf16"}}),
        (False, {"ppo": {"advantage": "grpo"}, "rollout": {"batch_size": 2, "samples_per_prompt": 3}}),
        (True, {"rollout": {"asynchronous": True}}),
        (False, {"rollout": {"environment": EPISODES, "max_turns": 3, "max_new_tokens": 12}}),
    ],
    # the third is split inside its warmup; the last has no critic and samples 3 responses per prompt
    # asynchronous: the batch sampled during step 2's update is saved with its checkpoint and trained on
    ids=[
        "full",
        "lora",
        "lora-checkpointed-critic-warmup",
        "bf16",
        "grpo-groups",
        "asynchronous",
        "episodes",
    ],
)
def test_resume_is_exact(run_files, lora, sections):
    """N steps in one go == k steps, stop, resume for N-k: same metrics, bit-identical weights."""
    models = {"policy_lora": {"enabled": True, "r": 4, "alpha": 8}} if lora else {}
    straight = write_config(
        run_files,
        **{
            **sections,
            "run": {"steps": 4, "output_dir": str(run_files.parent / "straight"), **sections.get("run", {})},
            "models": {**yaml.safe_load(run_files.read_text())["models"], **models},
        },
    )
    assert run_cli("ppo", str(straight)) == 0
    split = write_config(straight, run={"steps": 2, "output_dir": str(run_files.parent / "split")})
    assert run_cli("ppo", str(split)) == 0
    in_flight = load_checkpoint(latest_checkpoint(run_files.parent / "split")).tensors.get("pending_rollout")
    assert (in_flight is not None) == sections.get("rollout", {}).get("asynchronous", False)
    assert run_cli("ppo", "--resume", str(run_files.parent / "split"), "run.steps=4") == 0

    a, b = run_files.parent / "straight", run_files.parent / "split"
    assert comparable(read_metrics(a)) == comparable(read_metrics(b))
    tensors_a, tensors_b = policy_tensors(a), policy_tensors(b)
    assert tensors_a.keys() == tensors_b.keys()
    assert all(torch.equal(tensors_a[k], tensors_b[k]) for k in tensors_a)
    if lora:
        assert all("lora_" in k for k in tensors_a)  # the adapter alone is saved
    saved_a, saved_b = (load_checkpoint(latest_checkpoint(d)).tensors for d in (a, b))
    if "advantage" in sections.get("ppo", {}):  # critic-free: nothing of a critic is saved or logged
        assert "value" not in saved_a and not any(k.startswith("value/") for r in read_metrics(a) for k in r)
        return
    assert all(torch.equal(saved_a["value"][k], saved_b["value"][k]) for k in saved_a["value"])


def test_a_plain_run_evaluates_held_out_prompts_every_n_steps_and_resumes_exactly_across_one(run_files):
    """``data.eval_prompts`` + ``run.eval_every`` in ``lmppo ppo``: the starting policy at step 0, then every
    2 steps (RM score, judge, KL, length, EOS, demonstration perplexity); a run split at an evaluation
    and resumed logs the same records as one that was not."""
    demos = run_files.parent / "demos.jsonl"
    demos.write_text("".join(json.dumps({"prompt": p, "response": "a good day"}) + "\n" for p in PROMPTS))
    data = {
        **yaml.safe_load(run_files.read_text())["data"],
        "eval_prompts": str(run_files.parent / "prompts.jsonl"),
        "eval_judge": GOOD_JUDGE,
        "eval_demonstrations": str(demos),
    }
    straight = write_config(
        run_files,
        data=data,
        run={"steps": 4, "eval_every": 2, "output_dir": str(run_files.parent / "straight")},
    )
    assert run_cli("ppo", str(straight)) == 0
    records = read_metrics(run_files.parent / "straight")
    evaluated = [r for r in records if "eval/gold_score" in r]
    assert [r["step"] for r in evaluated] == [0, 2, 4] and [r["step"] for r in records] == [0, 1, 2, 3, 4]
    for record in evaluated:
        assert {
            "eval/reward/rm_score",
            "eval/kl/ref",
            "eval/response/length",
            "eval/demo_ppl",
        } <= record.keys()
    assert evaluated[0]["eval/kl/ref"] == 0  # the starting policy is the reference
    assert evaluated[-1]["eval/kl/ref"] != 0

    # best: the first step with the highest judge score, kept as a checkpoint and exported when earlier
    scores = [r["eval/gold_score"] for r in evaluated]
    best_step = evaluated[scores.index(max(scores))]["step"]
    run_dir = run_files.parent / "straight"
    assert best_checkpoint(run_dir).name == f"step-{best_step:06d}"
    assert (run_dir / "best").is_dir() == (best_step != 4)
    if best_step != 4:
        best_weights = load_checkpoint(best_checkpoint(run_dir)).tensors["policy"]
        exported = AutoModelForCausalLM.from_pretrained(run_dir / "best").state_dict()
        assert all(torch.equal(exported[k], best_weights[k]) for k in best_weights)

    split = write_config(straight, run={"steps": 2, "output_dir": str(run_files.parent / "split")})
    assert run_cli("ppo", str(split)) == 0
    assert run_cli("ppo", "--resume", str(run_files.parent / "split"), "run.steps=4") == 0
    assert comparable(read_metrics(run_files.parent / "split")) == comparable(records)
    assert best_checkpoint(run_files.parent / "split").name == best_checkpoint(run_dir).name


def test_resume_refuses_a_changed_config_unless_allowed(run_files):
    assert run_cli("ppo", str(run_files)) == 0
    run_dir = run_files.parent / "run"
    assert run_cli("ppo", "--resume", str(run_dir), "run.steps=3", "ppo.lr=0.5") == 2
    assert run_cli("ppo", "--resume", str(run_dir), "run.steps=3", "ppo.lr=0.5", "--allow-config-change") == 0
    manifest = json.loads((latest_checkpoint(run_dir) / "manifest.json").read_text())
    assert any("ppo.lr" in d for d in manifest["resumed_with_differences"])
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2, 3]


def test_an_allowed_config_change_takes_effect_and_the_next_resume_accepts_it(run_files, capsys):
    assert run_cli("ppo", str(run_files)) == 0
    run_dir = run_files.parent / "run"
    assert (
        run_cli(
            "ppo",
            "--resume",
            str(run_dir),
            "run.steps=3",
            "ppo.lr=0.5",
            "kl.beta=0.2",
            "--allow-config-change",
        )
        == 0
    )
    saved = load_checkpoint(latest_checkpoint(run_dir))
    optimizer = unflatten_state(saved.tensors["optimizer"], saved.state["optimizer"])
    assert [g["lr"] for g in optimizer["param_groups"]] == [0.5, 0.5]  # not the checkpoint's 1e-3
    assert read_metrics(run_dir)[-1]["kl/beta"] == 0.2
    assert load_config(run_dir / "config.yaml").ppo.lr == 0.5  # the run's config says what it trains with
    assert run_cli("ppo", "--resume", str(run_dir), "run.steps=4") == 0  # a plain resume goes on
    # A change the checkpoint's weights would undo is refused even when allowed.
    assert (
        run_cli(
            "ppo",
            "--resume",
            str(run_dir),
            "run.steps=5",
            "models.policy_lora.enabled=true",
            "--allow-config-change",
        )
        == 2
    )
    assert "cannot change the policy" in capsys.readouterr().err


def test_a_reward_that_turns_nan_stops_its_step_naming_the_reward_before_any_update(run_files, capsys):
    """A non-finite score is the reward's fault: the step stops with that cause before an update uses it
    (no guard blaming the learning rate), and the last checkpoint is the one before."""
    config = write_config(
        run_files, reward={"function": "nan_reward:score"}, run={"steps": 5, "checkpoint_every": 1}
    )
    (run_files.parent / "nan_reward.py").write_text(
        "calls = 0\n"
        "def score(prompts, responses):\n"
        "    global calls\n"
        "    calls += 1\n"
        "    return [float('nan') if calls >= 4 else 1.0 for _ in responses]\n"  # call 1: the pre-flight
    )
    sys.path.insert(0, str(run_files.parent))
    try:
        assert run_cli("ppo", str(config)) == 2  # the reward's input error, not a guard's abort (3)
    finally:
        sys.path.remove(str(run_files.parent))
    err = capsys.readouterr().err
    assert "reward function nan_reward:score scored 4 of 4 responses with a non-finite value" in err
    assert "stopped in step 3" in err and "step-000002, is intact" in err and "learning rate" not in err
    run_dir = run_files.parent / "run"
    assert latest_checkpoint(run_dir).name == "step-000002"
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2]


def test_a_reward_that_is_nan_from_the_start_is_refused_by_the_preflight_and_nothing_is_written(
    run_files, capsys
):
    (run_files.parent / "nan_reward.py").write_text(
        "def score(prompts, responses):\n    return [float('inf') if i == 1 else 1.0 for i in range(len(responses))]\n"
    )
    config = write_config(run_files, reward={"function": f"{run_files.parent / 'nan_reward.py'}:score"})
    assert run_cli("ppo", str(config)) == 2
    err = capsys.readouterr().err
    assert re.search(r"scored 1 of \d+ responses with a non-finite value, e\.g\. inf for prompt '", err)
    assert "before step 1" in err and "nothing was written" in err
    assert not (run_files.parent / "run").exists()


def _start_run(config, env_extra=None):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "lmppo", "ppo", str(config), "--quiet"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for_step(run_dir, step, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
        if records and records[-1]["step"] >= step:
            return
        time.sleep(0.05)
    raise AssertionError(
        f"run did not reach step {step}: {proc.stdout.read() if proc.poll() is not None else ''}"
    )


@pytest.mark.slow
def test_sigterm_saves_and_resume_continues(run_files):
    config = write_config(run_files, run={"steps": 40})
    run_dir = run_files.parent / "run"
    proc = _start_run(config)
    _wait_for_step(run_dir, 1, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out  # saved, but unfinished: a scheduler requeues it
    assert f"continue with `lmppo ppo --resume {run_dir}`" in out and "Traceback" not in out
    stopped = latest_checkpoint(run_dir)
    manifest = json.loads((stopped / "manifest.json").read_text())
    assert manifest["tag"] == "interrupted" and 0 < manifest["step"] < 40
    assert run_cli("ppo", "--resume", str(run_dir), "run.steps=" + str(manifest["step"] + 1)) == 0
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(manifest["step"] + 2))


@pytest.mark.slow
def test_sigkill_at_random_moments_always_resumes_from_an_intact_checkpoint(run_files):
    """Kill -9 during training and during checkpoint writes (one every step); each resume finds an intact one."""
    config = write_config(run_files, run={"steps": 200, "checkpoint_every": 1, "keep_last": 2})
    run_dir = run_files.parent / "run"
    proc = _start_run(config)
    _wait_for_step(run_dir, 1, proc)
    for delay in (0.37, 0.81, 1.53):
        time.sleep(delay)
        proc.kill()
        proc.wait()
        checkpoint = load_checkpoint(latest_checkpoint(run_dir))  # verifies every file's hash
        assert all(torch.isfinite(t).all() for t in checkpoint.tensors["policy"].values())
        proc = subprocess.Popen(
            [sys.executable, "-m", "lmppo", "ppo", "--resume", str(run_dir), "--quiet"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    proc.kill()
    proc.wait()
    step = load_checkpoint(latest_checkpoint(run_dir)).step
    assert run_cli("ppo", "--resume", str(run_dir), f"run.steps={step + 1}") == 0
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(step + 2))


# `lmppo ARGS`, SIGKILLed as soon as its first checkpoint (step 0's) is saved: before metrics.jsonl exists
KILLED_AFTER_THE_FIRST_CHECKPOINT = """
import os, signal, sys
from lmppo.interface.cli import main
from lmppo.runs.run import PPORun
save = PPORun.save
def save_and_die(self, *args, **kwargs):
    save(self, *args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)
PPORun.save = save_and_die
sys.argv = ["lmppo", *sys.argv[1:]]
main()
"""


@pytest.mark.slow
def test_a_kill_between_the_first_checkpoint_and_the_first_record_loses_no_step_0(run_files):
    """Step 0's record (the held-out evaluation, the reward pre-flight) rides with the checkpoint: the
    resumed run writes it back as its first record."""
    held_out = {"eval_prompts": str(run_files.parent / "prompts.jsonl"), "eval_judge": GOOD_JUDGE}
    config = write_config(run_files, data=held_out, run={"eval_every": 2})
    run_dir = run_files.parent / "run"
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_AFTER_THE_FIRST_CHECKPOINT, "ppo", str(config), "--quiet"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert latest_checkpoint(run_dir).name == "step-000000" and not (run_dir / "metrics.jsonl").exists()
    saved = load_checkpoint(latest_checkpoint(run_dir)).state["start"]
    assert "eval/gold_score" in saved and any(name.startswith("preflight/") for name in saved)
    assert run_cli("ppo", "--resume", str(run_dir), "run.steps=1") == 0
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1]
    assert {k: v for k, v in records[0].items() if k not in ("step", "time")} == saved


@pytest.mark.slow
def test_a_run_directory_has_one_writer_until_its_process_dies(run_files):
    """A second `lmppo ppo` on a live run's directory is refused and changes nothing of it; once the first
    is SIGKILLed (no clean-up ran), --resume takes the directory over at once."""
    config = write_config(run_files, run={"steps": 200})
    run_dir = run_files.parent / "run"
    first = _start_run(config)
    _wait_for_step(run_dir, 1, first)
    for args in (["--resume", str(run_dir)], [str(config)]):
        second = subprocess.run(
            [sys.executable, "-m", "lmppo", "ppo", *args, "--quiet"], capture_output=True, text=True
        )
        assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr
        assert "is in use" in second.stderr and f"process {first.pid} on" in second.stderr
    assert first.poll() is None  # the live run went on
    first.kill()
    first.wait()
    step = load_checkpoint(latest_checkpoint(run_dir)).step
    assert run_cli("ppo", "--resume", str(run_dir), f"run.steps={step + 1}") == 0
    assert not (run_dir / ".lmppo.lock").exists()  # released at the end of the run


def test_an_output_dir_that_cannot_be_written_is_a_clear_error(run_files, capsys):
    (run_files.parent / "notes").write_text("a file where a directory would have to be")
    config = write_config(run_files, run={"output_dir": str(run_files.parent / "notes" / "run")})
    assert run_cli("ppo", str(config)) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "cannot write in run.output_dir=" in err and "Traceback" not in err


def test_a_bad_run_leaves_no_run_directory_behind(run_files, capsys):
    """The lock creates the run directory; a run refused before writing anything removes it again."""
    config = write_config(run_files, data={"prompts": str(run_files.parent / "missing.jsonl")})
    assert run_cli("ppo", str(config)) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    assert not (run_files.parent / "run").exists()


def test_a_reward_function_that_raises_shows_its_frames_the_step_and_the_intact_checkpoint(run_files, capsys):
    (run_files.parent / "flaky.py").write_text(
        "calls = 0\n"
        "def score(prompts, responses):\n"
        "    global calls\n"
        "    calls += 1\n"
        "    return [1.0 / (len(r) - len(r)) if calls > 1 else 0.0 for r in responses]\n"  # call 1: pre-flight
    )
    config = write_config(run_files, reward={"function": f"{run_files.parent / 'flaky.py'}:score"})
    assert run_cli("ppo", str(config)) == 2
    err = capsys.readouterr().err
    assert "raised ZeroDivisionError" in err and "flaky.py" in err and "line 5" in err  # the user's frame
    assert "stopped in step 1" in err and "step-000000" in err and "is intact" in err and "--resume" in err
    assert "Traceback (most recent call last)" not in err and "lmppo/training/trainer.py" not in err


def test_a_reward_function_that_raises_in_the_preflight_stops_before_anything_is_saved(run_files, capsys):
    (run_files.parent / "broken.py").write_text("def score(prompts, responses):\n    return 1 / 0\n")
    config = write_config(run_files, reward={"function": f"{run_files.parent / 'broken.py'}:score"})
    assert run_cli("ppo", str(config)) == 2
    err = capsys.readouterr().err
    assert "raised ZeroDivisionError" in err and "broken.py" in err and "before step 1" in err
    assert "nothing was written" in err and "Traceback (most recent call last)" not in err
    assert not (run_files.parent / "run").exists()  # not even its config.yaml: the directory is gone
    assert run_cli("ppo", str(run_files)) == 0  # fixed (here: the original reward), the same run starts


def test_a_reward_file_with_a_syntax_error_names_the_line(run_files, capsys):
    (run_files.parent / "broken.py").write_text(
        "def score(prompts, responses):\n    return [1.0 for r in responses\n"
    )
    config = write_config(run_files, reward={"function": f"{run_files.parent / 'broken.py'}:score"})
    assert run_cli("ppo", str(config)) == 2
    err = capsys.readouterr().err
    assert "broken.py, line 2" in err and "Traceback" not in err


def test_an_over_long_prompt_is_named_by_file_and_line_before_any_step(run_files, capsys):
    prompts = run_files.parent / "prompts.jsonl"
    prompts.write_text(prompts.read_text() + json.dumps({"prompt": "the cat " * 100}) + "\n")
    lines = len(prompts.read_text().splitlines())
    assert run_cli("ppo", str(run_files)) == 2
    err = capsys.readouterr().err
    assert f"prompts.jsonl, line {lines} is" in err and "data.truncate_prompts" in err
    assert not (run_files.parent / "run" / "metrics.jsonl").exists()  # refused before the first step


def test_resume_past_a_damaged_newest_checkpoint_warns_and_redoes_its_steps(run_files):
    config = write_config(run_files, run={"steps": 2, "checkpoint_every": 1, "keep_last": 3})
    assert run_cli("ppo", str(config)) == 0
    run_dir = run_files.parent / "run"
    newest = latest_checkpoint(run_dir)
    (newest / "policy.safetensors").write_bytes(b"torn")
    resumed = subprocess.run(  # a process of its own: what the user reads on stderr
        [sys.executable, "-m", "lmppo", "ppo", "--resume", str(run_dir), "run.steps=3"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    warning = "warning: --resume: set aside damaged checkpoint(s)"
    assert (
        warning in resumed.stderr
        and "step-000002" in resumed.stderr
        and "resuming from step-000001" in resumed.stderr
    )
    assert (
        "UserWarning" not in resumed.stderr and "run.py" not in resumed.stderr
    )  # no file:line, no source line
    assert (run_dir / "checkpoints" / "damaged-step-000002").is_dir()
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2, 3]  # step 2 trained again, once in the log


def test_checkpoints_of_steps_that_break_a_rule_in_warm_up_are_not_last_good(run_files):
    config = write_config(
        run_files, run={"checkpoint_every": 1}, guards={"warmup_steps": 10, "value_loss_max": 1e-30}
    )
    assert run_cli("ppo", str(config)) == 0  # every step breaks the value rule, inside its warm-up
    tags = {
        p.name: json.loads((p / "manifest.json").read_text())["tag"]
        for p in (run_files.parent / "run" / "checkpoints").glob("step-*")
    }
    assert tags == {"step-000000": "ok", "step-000001": "unhealthy", "step-000002": "unhealthy"}
    assert last_good_checkpoint(run_files.parent / "run").name == "step-000000"


def test_reward_components_are_logged_apart_and_their_normalisation_resumes_exactly(run_files):
    (run_files.parent / "length.py").write_text(
        "def score(prompts, responses):\n    return [float(len(r.split())) for r in responses]\n"
    )
    config = yaml.safe_load(run_files.read_text())
    config["reward"] = {
        "components": [
            {"name": "good", "function": COUNT_GOOD, "normalize": True},
            {"name": "length", "function": f"{run_files.parent / 'length.py'}:score", "weight": -0.1,
             "normalize": True, "clip": 2.0},
        ]
    }  # fmt: skip
    config["run"].update(steps=4, output_dir=str(run_files.parent / "straight"))
    straight = run_files.parent / "components.yaml"
    straight.write_text(yaml.safe_dump(config))
    assert run_cli("ppo", str(straight)) == 0
    records = read_metrics(run_files.parent / "straight")[1:]
    for r in records:
        assert r["reward/rm_score_used"] == pytest.approx(r["reward/good/used"] + r["reward/length/used"])
        assert r["reward/rm_score"] == pytest.approx(r["reward/good/raw"] - 0.1 * r["reward/length/raw"])
        assert {"reward/good/norm_mean", "reward/length/norm_std", "reward/length/clip_frac"} <= r.keys()
    assert records[-1]["reward/length/norm_mean"] != records[0]["reward/length/norm_mean"]  # running

    split = write_config(straight, run={"steps": 2, "output_dir": str(run_files.parent / "split")})
    assert run_cli("ppo", str(split)) == 0
    assert run_cli("ppo", "--resume", str(run_files.parent / "split"), "run.steps=4") == 0
    assert comparable(read_metrics(run_files.parent / "split")) == comparable(
        read_metrics(run_files.parent / "straight")
    )
    card = (run_files.parent / "straight" / "final" / "README.md").read_text()
    assert "good: 1 x" in card and "length: -0.1 x" in card


def test_the_run_says_its_numerics_and_why(run_files):
    spec = resolve(load_config(run_files, ["run.precision=fp32"]), device="cpu")
    assert numerics_line(spec) == "precision fp32 on cpu: set by run.precision"
    fast = resolve(
        load_config(run_files, ["run.precision=auto", "run.fp32_matmul_precision=medium"]), device="cpu"
    )
    assert "fp32 matmuls medium" in numerics_line(fast) and "run.precision=auto" in numerics_line(fast)


def test_the_console_tells_each_stage_the_held_out_scores_and_where_the_results_are(run_files, capsys):
    config = write_config(
        run_files,
        data={"eval_prompts": str(run_files.parent / "prompts.jsonl"), "eval_judge": GOOD_JUDGE},
        run={"eval_every": 2, "precision": "auto"},
    )
    assert run_cli("ppo", str(config)) == 0
    out = capsys.readouterr().out.splitlines()
    stages = ["checking the memory plan", "loading the policy", "building the trainer", "reward pre-flight"]
    assert all(any(line.startswith(stage) for line in out) for stage in stages), out
    assert out[0].startswith("lmppo ppo: starting") and out[1].startswith(
        "precision fp32 on cpu: run.precision=auto"
    )
    assert any(line.startswith("held-out at step 0: reward ") and "gold" in line for line in out)
    assert any(line.startswith("held-out at step 2: reward ") for line in out)
    assert out[-1].startswith(f"done: the trained policy is in {run_files.parent / 'run' / 'final'}")
    assert max(len(line) for line in out if line.startswith("step ")) <= 80
    assert run_cli("ppo", "--resume", str(run_files.parent / "run"), "run.steps=3") == 0
    resumed = capsys.readouterr().out
    assert "precision" not in resumed and "step 3/3" in resumed  # the advisory once per run directory


def test_resuming_a_finished_run_says_so_and_writes_nothing(run_files, capsys):
    assert run_cli("ppo", str(run_files)) == 0
    run_dir = run_files.parent / "run"
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    capsys.readouterr()
    assert run_cli("ppo", "--resume", str(run_dir)) == 0
    err = capsys.readouterr().err
    assert "has already trained all run.steps=2 steps" in err and "nothing to do" in err
    assert f"lmppo ppo --resume {run_dir} run.steps=4" in err
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before
