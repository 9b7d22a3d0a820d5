import copy
import io
import json
import math
from unittest.mock import ANY

import pytest
import torch
import yaml
from helpers import run_cli
from rich.console import Console

from lmppo.errors import LmppoError
from lmppo.runs.evaluate import (
    EvalResult,
    compare_policies,
    evaluate_policy,
    reward_text,
    summary_columns,
    summary_table,
    win_rate,
)

PROMPTS = ["tell me a story", "write a poem", "tell me about the sun", "write a short story"] * 3
DEMOS = [
    {"prompt": "tell me a story", "response": "a good day"},
    {"prompt": "write a poem", "response": "the sun is happy"},
]


def word_count(prompts, responses) -> torch.Tensor:
    """A tiny reward function: longer is better."""
    return torch.tensor([float(len(r.split())) for r in responses])


def says_good(prompt, response) -> float:
    """A tiny gold judge."""
    return float("good" in response.split())


def evaluate(policy, tokenizer, **overrides) -> EvalResult:
    settings = {
        "reward_fn": word_count,
        "generator_options": {"max_new_tokens": 6},
        "batch_size": 5,
        "seed": 0,
    }
    return evaluate_policy(policy, tokenizer, PROMPTS, **{**settings, **overrides})


def perturbed(model, scale: float = 0.5, seed: int = 1):
    model = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator))
    return model


def test_metrics_rows_and_slices(policy_model, policy_tokenizer):
    result = evaluate(
        policy_model, policy_tokenizer, reference=copy.deepcopy(policy_model), gold_fn=says_good,
        demonstrations=DEMOS, slices=[prompt.split()[0] for prompt in PROMPTS],
    )  # fmt: skip
    expected = {
        "eval/reward/rm_score",
        "eval/gold_score",
        "eval/kl/ref",
        "eval/demo_ppl",
        "eval/response/length",
        "eval/response/eos_frac",
    }
    assert set(result.metrics) == expected
    assert all(math.isfinite(v) for v in result.metrics.values())
    assert result.metrics["eval/demo_ppl"] > 1.0
    assert 0.0 <= result.metrics["eval/response/eos_frac"] <= 1.0
    assert 1.0 <= result.metrics["eval/response/length"] <= 6.0

    assert [row["prompt"] for row in result.rows] == PROMPTS
    for row in result.rows:
        assert row["rm_score"] == len(row["response"].split())
        assert row["gold_score"] == says_good(row["prompt"], row["response"])
    assert result.metrics["eval/reward/rm_score"] == pytest.approx(
        sum(r["rm_score"] for r in result.rows) / len(PROMPTS)
    )

    assert set(result.slices) == {"tell", "write"}
    assert sum(s["n"] for s in result.slices.values()) == len(PROMPTS)
    tell = [r["length"] for r in result.rows if r["slice"] == "tell"]
    assert result.slices["tell"]["eval/response/length"] == pytest.approx(sum(tell) / len(tell))


def test_optional_inputs_leave_their_metrics_out(policy_model, policy_tokenizer):
    result = evaluate(policy_model, policy_tokenizer)
    assert set(result.metrics) == {"eval/reward/rm_score", "eval/response/length", "eval/response/eos_frac"}
    assert result.slices == {}
    assert "gold_score" not in result.rows[0] and "kl_ref" not in result.rows[0]


def test_kl_to_reference_is_zero_for_the_reference_and_positive_after_a_change(
    policy_model, policy_tokenizer
):
    same = evaluate(policy_model, policy_tokenizer, reference=copy.deepcopy(policy_model))
    assert same.metrics["eval/kl/ref"] == 0.0
    moved = evaluate(perturbed(policy_model), policy_tokenizer, reference=policy_model)
    assert moved.metrics["eval/kl/ref"] > 0.5


def test_same_seed_same_responses_and_training_rng_untouched(policy_model, policy_tokenizer):
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = evaluate(policy_model, policy_tokenizer, seed=7)
    assert torch.equal(torch.get_rng_state(), state)  # periodic eval must not shift PPO's sampling
    again = evaluate(policy_model, policy_tokenizer, seed=7)
    other = evaluate(policy_model, policy_tokenizer, seed=8)
    assert [r["response"] for r in first.rows] == [r["response"] for r in again.rows]
    assert [r["response"] for r in first.rows] != [r["response"] for r in other.rows]


def test_no_prompts_is_a_user_error(policy_model, policy_tokenizer):
    with pytest.raises(LmppoError, match="no held-out prompts"):
        evaluate_policy(
            policy_model, policy_tokenizer, [], reward_fn=word_count, generator_options={"max_new_tokens": 4}
        )


def test_win_rate_counts_ties_half():
    assert win_rate([1.0, 2.0, 3.0], [0.0, 2.0, 4.0]) == pytest.approx(0.5)
    assert win_rate([2.0, 2.0], [1.0, 1.0]) == 1.0
    assert win_rate([1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 2.0, 3.0]) == pytest.approx(0.375)
    with pytest.raises(ValueError):
        win_rate([1.0], [1.0, 2.0])


def fake_result(gold: list[float] | None, prompts=("a", "b", "c"), rm: float = 1.0) -> EvalResult:
    rows = [{"prompt": p, "response": "x", "rm_score": rm} for p in prompts]
    metrics = {"eval/reward/rm_score": rm, "eval/response/length": 3.0}
    if gold is not None:
        for row, g in zip(rows, gold):
            row["gold_score"] = g
        metrics["eval/gold_score"] = sum(gold) / len(gold)
    return EvalResult(metrics=metrics, rows=rows)


def test_compare_policies_win_rate_against_the_first_under_gold():
    summary = compare_policies(
        {"sft": fake_result([1.0, 1.0, 1.0]), "ppo": fake_result([2.0, 1.0, 0.0], rm=5.0)}
    )
    assert summary["baseline"] == "sft" and summary["judge"] == "gold"
    assert summary["policies"]["ppo"]["eval/win_rate"] == pytest.approx(0.5)
    assert "eval/win_rate" not in summary["policies"]["sft"]
    assert summary["policies"]["ppo"]["eval/reward/rm_score"] == 5.0

    text = io.StringIO()
    Console(file=text, width=200).print(summary_table(summary))
    rendered = text.getvalue()
    assert "win rate vs sft (gold)" in rendered and "KL to ref" not in rendered  # no reference given
    assert "ppo" in rendered and "0.5" in rendered


def test_compare_policies_falls_back_to_the_reward_model_and_checks_prompts():
    summary = compare_policies({"sft": fake_result(None, rm=1.0), "ppo": fake_result(None, rm=2.0)})
    assert summary["judge"] == "rm" and summary["policies"]["ppo"]["eval/win_rate"] == 1.0
    with pytest.raises(LmppoError, match="baseline 'rl'"):
        compare_policies({"sft": fake_result(None)}, baseline="rl")
    with pytest.raises(LmppoError, match="different prompts"):
        compare_policies({"sft": fake_result(None), "ppo": fake_result(None, prompts=("a", "b", "z"))})


def test_lmppo_eval_judges_start_and_final_policy_with_the_configured_judge(run_files, tmp_path):
    (tmp_path / "judge.py").write_text(
        "def brief(prompt, response):\n    return float(len(response.split()) <= 3)\n"
    )
    config = yaml.safe_load(run_files.read_text())
    config["data"].update(eval_prompts=config["data"]["prompts"], eval_judge=f"{tmp_path / 'judge.py'}:brief")
    run_files.write_text(yaml.safe_dump(config))
    assert run_cli("ppo", str(run_files)) == 0
    run_dir = run_files.parent / "run"
    assert run_cli("eval", str(run_dir)) == 0
    record = json.loads((run_dir / "eval.json").read_text())
    for name in ("start", "PPO"):
        rows = record["policies"][name]["rows"]
        assert {row["gold_score"] for row in rows} <= {0.0, 1.0}
        expected = sum(float(len(row["response"].split()) <= 3) for row in rows) / len(rows)
        assert record["policies"][name]["metrics"]["eval/gold_score"] == pytest.approx(expected)
    assert record["summary"]["judge"] == "gold"  # the win rate is decided by the configured judge


def test_lmppo_eval_uses_the_runs_device_and_precision(run_files, monkeypatch):
    """Both policies are frozen here: 16-bit weights and bf16 autocast under run.precision=bf16, on the
    run's device (it used to load them in fp32 on the CPU whatever the run said)."""
    config = yaml.safe_load(run_files.read_text())
    config["data"]["eval_prompts"] = config["data"]["prompts"]
    config["run"].update(precision="bf16", steps=1)
    run_files.write_text(yaml.safe_dump(config))
    assert run_cli("ppo", str(run_files)) == 0
    seen = []

    def record(policy, tokenizer, prompts, **kwargs):
        weights = next(policy.parameters())
        seen.append((weights.dtype, weights.device.type, torch.is_autocast_enabled("cpu")))
        return evaluate_policy(policy, tokenizer, prompts[:2], **kwargs)

    monkeypatch.setattr("lmppo.runs.evaluate.evaluate_policy", record)
    assert run_cli("eval", str(run_files.parent / "run")) == 0
    assert seen == [(torch.bfloat16, "cpu", True)] * 2


def test_a_judge_that_raises_is_shown_as_the_users_code(policy_model, policy_tokenizer):
    def judge(prompt, response):
        raise KeyError(prompt)

    with pytest.raises(LmppoError, match=r"the held-out judge judge raised KeyError") as err:
        evaluate(policy_model, policy_tokenizer, gold_fn=judge)
    assert "test_evaluate.py" in str(err.value)  # the judge's own frame


def test_each_named_reward_component_is_evaluated_apart(policy_model, policy_tokenizer):
    from lmppo.rewards.scoring import CombinedReward, ScoredComponent

    reward = CombinedReward(
        [
            ScoredComponent("words", word_count),
            ScoredComponent("good", lambda p, r: torch.tensor([1.0] * len(r)), 2.0),
        ],
        named=True,
    )
    result = evaluate(policy_model, policy_tokenizer, reward_fn=reward)
    words = result.metrics["eval/reward/words/raw"]
    assert result.metrics["eval/reward/good/raw"] == 1.0
    assert result.metrics["eval/reward/rm_score"] == pytest.approx(
        words + 2.0
    )  # the weighted sum of the raw ones
    assert all(set(row["components"]) == {"words", "good"} for row in result.rows)


def episode_result(final: float, turn: float) -> EvalResult:
    """One held-out episode scored ``final`` by the run's reward and ``turn`` by its environment."""
    row = {
        "prompt": "p",
        "response": "r",
        "rm_score": final,
        "turn_reward": turn,
        "total_reward": final + turn,
    }
    metrics = {"eval/reward/rm_score": final, "eval/reward/turn": turn, "eval/reward/total": final + turn}
    return EvalResult(metrics=metrics, rows=[{**row, "length": 3, "eos": True}])


def test_an_episode_is_judged_and_shown_by_its_reward_the_final_score_plus_its_turn_rewards():
    environment_only = {"start": episode_result(0.0, 0.0), "PPO": episode_result(0.0, 0.5)}
    summary = compare_policies(environment_only, score="environment reward")
    assert summary["policies"]["PPO"]["eval/win_rate"] == 1.0  # not a tie on the final score of 0
    assert summary_columns(summary)[:2] == [
        ("eval/reward/total", "environment reward"),
        ("eval/win_rate", ANY),
    ]
    both = compare_policies(
        {"start": episode_result(1.0, 0.5), "PPO": episode_result(0.5, 0.5)}, score="reward"
    )
    labels = [label for _, label in summary_columns(both)]
    assert labels[:4] == ["reward", "final score", "turn reward", "win rate vs start (reward)"]
    assert both["policies"]["PPO"]["eval/win_rate"] == 0.0
    row = episode_result(1.0, 0.5).rows[0]
    assert reward_text(row) == "reward 1.5 (final 1, turn 0.5)"
    assert reward_text({**row, "rm_score": 0.0, "total_reward": 0.5}) == "reward 0.5"  # the turns' alone
    assert reward_text({"rm_score": 0.25}) == "RM 0.25"  # no episode: as ever
