"""The reward pre-flight: statistics of the starting policy's samples, and the length-bias rule on them."""

import hashlib
import json

import pytest
import torch
from helpers import BASE, boost_token, run_cli, toy_models, write_config
from rich.console import Console
from sample_environments import SPEC as EPISODES

from lmppo.inputs.config import ModelSource, load_config
from lmppo.modeling.loading import load_tokenizer
from lmppo.runs.diagnose import reward_bias
from lmppo.runs.preflight import (
    average_ranks,
    correlation,
    preflight_tables,
    run_preflight,
    spearman,
    summarise,
    summary_line,
)

PROMPTS = ["tell me about the cat", "write a short poem", "tell me a story", "the day was very happy"]


def word_count(prompts, responses) -> torch.Tensor:
    """Deliberately length-biased: every word is worth a point."""
    return torch.tensor([float(len(r.split())) for r in responses])


def text_hash(prompts, responses) -> torch.Tensor:
    """Length-neutral: a score in [0, 1) from a hash of the text, unrelated to its length."""
    return torch.tensor([hashlib.sha256(r.encode()).digest()[0] / 256 for r in responses])


def test_ranks_share_ties_and_spearman_sees_any_monotone_relation():
    assert average_ranks(torch.tensor([3.0, 1.0, 3.0, 2.0])).tolist() == [3.5, 1.0, 3.5, 2.0]
    x = torch.arange(1.0, 20.0)
    assert spearman(x, x**3) == pytest.approx(1.0) and correlation(x, x**3) < 0.95
    assert spearman(x, -x) == pytest.approx(-1.0)
    assert spearman(x, torch.ones_like(x)) is None  # undefined, not 0


def test_statistics_overall_per_slice_and_the_extremes():
    rows = [
        {
            "prompt": "p",
            "response": "a " * n,
            "rm_score": float(n),
            "length": n,
            "eos": n < 4,
            "slice": str(n % 2),
        }
        for n in range(1, 9)
    ]
    result = summarise(rows)
    m = result.metrics
    assert m["preflight/samples"] == 8 and m["preflight/rm_score_mean"] == 4.5
    assert m["preflight/length_spearman"] == pytest.approx(1.0) and m["preflight/eos_corr"] < -0.5
    assert m["preflight/rm_score_p10"] < m["preflight/rm_score_p50"] < m["preflight/rm_score_p90"]
    assert sorted(result.slices) == ["0", "1"] and result.slices["0"]["n"] == 4
    assert result.slices["0"]["rm_score_mean"] == 5.0  # 2, 4, 6, 8
    assert [r["rm_score"] for r in result.examples["highest"]] == [8.0, 7.0, 6.0]
    assert [r["rm_score"] for r in result.examples["lowest"]] == [1.0, 2.0, 3.0]


def toy_policy():
    """A near-uniform toy policy with a likelier EOS: response lengths spread over 1-16 tokens."""
    models = toy_models()
    return boost_token(models.policy, models.tokenizer.eos_token_id, 1.0), models.tokenizer


def preflight_of(reward_fn, slices=None, policy=None):
    cfg = load_config(base=BASE, overrides=["rollout.max_new_tokens=16", "rollout.batch_size=32"])
    policy, tokenizer = policy or toy_policy()
    return run_preflight(cfg, policy, tokenizer, reward_fn, PROMPTS * 16, slices)


def test_a_length_biased_reward_is_flagged_and_a_length_neutral_one_is_not():
    biased = preflight_of(word_count)
    lengths = {row["length"] for row in biased.examples["highest"] + biased.examples["lowest"]}
    assert biased.metrics["preflight/samples"] == 64 and len(lengths) > 1  # the lengths vary
    finding = reward_bias([{"step": 0, **biased.metrics}], load_config(base=BASE).diagnosis)
    assert (
        finding is not None
        and "preflight/length_spearman" in finding.evidence
        and "longer" in finding.evidence
    )
    neutral = preflight_of(text_hash, slices=["a", "b", "c", "d"] * 16)
    assert abs(neutral.metrics["preflight/length_spearman"]) < 0.35
    assert reward_bias([{"step": 0, **neutral.metrics}], load_config(base=BASE).diagnosis) is None
    assert (
        sorted(neutral.slices) == ["a", "b", "c", "d"] and sum(s["n"] for s in neutral.slices.values()) == 64
    )


def test_the_preflight_leaves_the_training_rng_as_it_was():
    policy = toy_policy()
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    preflight_of(text_hash, policy=policy)
    assert torch.equal(torch.rand(3), expected)


LENGTH_REWARD = "def score(prompts, responses):\n    return [float(len(r.split())) for r in responses]\n"


def test_lmppo_check_rm_reports_the_bias_and_a_run_logs_it_at_step_0(run_files, capsys):
    (run_files.parent / "long.py").write_text(LENGTH_REWARD)
    (run_files.parent / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS * 8)
    )
    tokenizer = load_tokenizer(ModelSource(path=str(run_files.parent / "policy")))
    stops = tokenizer.convert_tokens_to_ids(["good", "bad", "fine", "cat", "day", "sun"])  # lengths vary
    rollout = {"batch_size": 16, "max_new_tokens": 12, "stop_token_ids": stops}
    config = write_config(
        run_files, reward={"function": f"{run_files.parent / 'long.py'}:score"}, rollout=rollout
    )
    assert run_cli("check-rm", str(config)) == 0
    out = capsys.readouterr().out
    assert "reward pre-flight" in out and "preflight/length_spearman" in out
    assert "reward_bias" in out and "longer" in out
    assert (
        run_cli("check-rm", str(write_config(run_files, rollout=rollout))) == 0
    )  # count_good: no length bias
    assert "no length or EOS bias" in capsys.readouterr().out

    assert run_cli("ppo", str(config)) == 0
    out = capsys.readouterr().out
    assert "reward pre-flight on 32 samples" in out and "diagnosis at step 0: reward_bias" in out
    run_dir = run_files.parent / "run"
    saved = json.loads((run_dir / "preflight.json").read_text())
    assert saved["metrics"]["preflight/length_spearman"] > 0.5 and saved["examples"]["highest"]
    assert run_cli("diagnose", str(run_dir)) == 0
    assert "reward_bias" in capsys.readouterr().out


def test_check_rm_reads_the_reward_whatever_the_update_settings(run_files, capsys):
    """check-rm scores samples; a minibatch that a PPO step could not fill is the update's business."""
    config = write_config(run_files, ppo={"minibatch_size": 64})
    assert run_cli("check-rm", str(config)) == 0
    assert "reward pre-flight" in capsys.readouterr().out
    assert run_cli("ppo", str(config)) == 2  # the run refuses it, before loading a model
    assert "ppo.minibatch_size=64 is larger than the 4 responses of a step" in capsys.readouterr().err


def test_check_rm_plays_episodes_on_fewer_prompts_than_its_batches_ask_for(run_files, capsys):
    """diagnosis.preflight_batches (2) x rollout.batch_size (16) asks for 32 samples of a 16-prompt file: the
    pre-flight samples each prompt once, episodes included (each resets on its own row)."""
    (run_files.parent / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": f"{p} {i}", "row": i}) + "\n" for i, p in enumerate(PROMPTS * 4))
    )
    rollout = {"batch_size": 16, "max_new_tokens": 6, "environment": EPISODES, "max_turns": 2}
    assert run_cli("check-rm", str(write_config(run_files, rollout=rollout))) == 0
    assert "reward pre-flight on 16 samples" in capsys.readouterr().out


def test_an_episode_is_scored_by_its_reward_and_shown_whole_with_its_context_apart():
    transcript = [
        {"text": "guess 3", "action": True},
        {"text": "<user>higher</user>", "action": False},
        {"text": "guess 7", "action": True},
    ]
    rows = [
        {
            "prompt": "p",
            "response": "guess 7",  # the last turn alone
            "episode": transcript,
            "rm_score": 0.0,
            "turn_reward": float(n),
            "total_reward": float(n),
            "length": 4 + n,
            "eos": True,
        }
        for n in range(4)
    ]
    preflight = summarise(rows)
    m = preflight.metrics
    assert m["preflight/total_reward_mean"] == 1.5 and m["preflight/total_reward_std"] > 0
    assert m["preflight/rm_score_mean"] == 0 and m["preflight/turn_reward_mean"] == 1.5
    assert m["preflight/length_spearman"] == pytest.approx(1.0)  # defined: the score varies
    assert "starting policy: reward 1.5 ± 1.12 (p10" in summary_line(preflight)
    assert preflight.examples["highest"][0]["episode"] == transcript
    console = Console(record=True, width=200)
    console.print(preflight_tables(preflight)[-1])
    assert "guess 3<user>higher</user>guess 7" in console.export_text()
