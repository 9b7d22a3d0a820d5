"""The Python API: the CLI's run from a dict, a YAML path or a Config, with a reward callable, prompt rows
and a per-step callback; the example in examples/python_api.py runs as documented."""

import importlib.util
from pathlib import Path

import pytest
import yaml
from helpers import PROMPTS, comparable, count_good, run_cli

import lmppo
from lmppo.errors import LmppoError
from lmppo.inputs.config import load_config
from lmppo.training.metrics import read_metrics
from lmppo.user_code import PYTHON_FUNCTIONS

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "python_api.py"


def load_example():
    spec = importlib.util.spec_from_file_location("python_api_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_trains_from_a_dict_rows_and_a_function_and_hands_back_the_policy(run_files, capsys):
    result = load_example().main(str(run_files.parent / "policy"), str(run_files.parent / "api"), steps=2)
    printed = capsys.readouterr().out
    assert (
        "step   0" not in printed
        and "step   1" in printed
        and "step   2" in printed
        and "trained policy: LlamaForCausalLM" in printed
    )
    assert [r["step"] for r in result.metrics] == [0, 1, 2]
    recorded = yaml.safe_load((result.run_dir / "config.yaml").read_text())
    assert recorded["reward"]["function"] == "python:counts_correctly"  # the run says what scored it
    assert recorded["data"]["prompts"] == [f"count to {n}" for n in range(3, 11)]


def test_the_api_takes_the_same_steps_as_the_cli_and_resumes_with_the_function_passed_again(run_files):
    """One code path: a YAML path plus a callable gives the CLI's records; a resumed run needs the
    function again (it lives in the process) and then continues."""
    assert run_cli("ppo", str(run_files)) == 0
    cli_records = read_metrics(run_files.parent / "run")
    seen = []
    api_dir = run_files.parent / "api"
    result = lmppo.train(
        run_files,
        overrides=[f"run.output_dir={api_dir}"],
        reward=count_good,
        prompts=PROMPTS * 2,
        on_step=lambda step, metrics: seen.append((step, metrics.get("reward/rm_score"))),
    )
    assert comparable(result.metrics) == comparable(cli_records)
    assert seen == [(r["step"], r.get("reward/rm_score")) for r in cli_records if r["step"] > 0]  # PPO steps

    PYTHON_FUNCTIONS.clear()  # as in a new process
    resumed = load_config(api_dir / "config.yaml", ["run.steps=3"])
    with pytest.raises(LmppoError, match="python:count_good' was a Python function given to lmppo.train"):
        lmppo.train(resumed, resume=True)
    assert [r["step"] for r in read_metrics(api_dir)] == [0, 1, 2]  # nothing lost
    assert lmppo.train(resumed, reward=count_good, resume=True).metrics[-1]["step"] == 3


def test_bad_input_to_the_api_is_the_clis_message(run_files):
    with pytest.raises(
        LmppoError, match=r"lmppo.train\): unknown key 'ppo.learning_rate': did you mean 'ppo.lr'\?"
    ):
        lmppo.train(run_files, overrides=["ppo.learning_rate=1e-5"])
    with pytest.raises(LmppoError, match="data.prompts item 2 has no prompt"):
        lmppo.train(run_files, prompts=["fine", {"text": "no prompt column"}])
    with pytest.raises(
        LmppoError, match="returned 1 scores for 8 responses.\n--- the run stopped before step 1"
    ):
        lmppo.train(run_files, reward=lambda prompts, responses: [1.0])
    assert not (run_files.parent / "run").exists()  # a failed start leaves no directory behind


class CountsOnce:
    """A one-turn environment that rewards a response holding 'good'."""

    def reset(self, row, seed):
        pass

    def step(self, text):
        from lmppo.sampling.environments import Step

        return Step(messages=[], reward=float("good" in text), done=True)


def test_an_environment_class_is_taken_as_the_reward_function_is(run_files):
    """lmppo.train(environment=Class), or the class in the config itself: recorded as python:NAME."""
    cfg = yaml.safe_load(run_files.read_text())
    cfg["run"]["steps"] = 1
    cfg["rollout"]["environment"] = CountsOnce
    result = lmppo.train(cfg)
    recorded = yaml.safe_load((result.run_dir / "config.yaml").read_text())
    assert recorded["rollout"]["environment"] == "python:CountsOnce"
    assert [r["step"] for r in result.metrics] == [0, 1] and "reward/turn" in result.metrics[1]
