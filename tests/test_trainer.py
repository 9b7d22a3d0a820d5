"""The PPO loop: learning on the seeds' toy reward, early stop, stale rollouts, ptx, accumulation, the CLI."""

import dataclasses
import json
import math

import pytest
import torch
import yaml
from conftest import POLICY_SPECIALS, POLICY_TEMPLATE, WORDS, build_tokenizer, llama_config
from transformers import LlamaForCausalLM

from lmppo.config import load_config
from lmppo.errors import LmppoError
from lmppo.metrics import METRIC_NAMES, read_metrics
from lmppo.models import ValueModel, make_reference
from lmppo.scoring import load_reward_function
from lmppo.trainer import PPOModels, PPOTrainer, seed_everything

PROMPTS = ["tell me about the cat", "write a short poem", "tell me a story", "the day was very happy"]
BASE = {
    "models": {"policy": {"path": "unused"}, "value": {"init_from": "policy"}},
    "reward": {"function": "lmppo.scoring:count_good"},
    "data": {"prompts": "unused"},
}


def toy_models(seed: int = 0, head_scale: float = 0.01) -> PPOModels:
    """A tiny Llama whose next-token distribution is near uniform (the seeds' near-uniform reference)."""
    tokenizer = build_tokenizer(POLICY_SPECIALS, list(WORDS), pad="<pad>", eos="</s>", bos="<s>",
                                chat_template=POLICY_TEMPLATE)
    torch.manual_seed(seed)
    policy = LlamaForCausalLM(llama_config(tokenizer))
    with torch.no_grad():
        policy.lm_head.weight.mul_(head_scale)
    reward = load_reward_function("lmppo.scoring:count_good")
    return PPOModels(policy, make_reference(policy), ValueModel.from_causal_lm(policy), tokenizer, reward)


def toy_trainer(*overrides: str, models: PPOModels | None = None, **kwargs) -> PPOTrainer:
    cfg = load_config(base=BASE, overrides=[
        "rollout.max_new_tokens=8", "rollout.batch_size=8", "ppo.minibatch_size=4", "ppo.ppo_epochs=2",
        "ppo.lr=3e-3", *overrides])
    seed_everything(cfg.run.seed)
    return PPOTrainer(cfg, models or toy_models(), PROMPTS * 4, **kwargs)


@pytest.mark.slow
def test_train_ppo_increases_reward_with_bounded_kl():
    """The seeds' sixth test: reward "count the token good" rises; the per-sequence KL stays bounded."""
    trainer = toy_trainer("rollout.batch_size=16", "ppo.minibatch_size=8", "kl.beta=0.3")
    history = [trainer.step() for _ in range(12)]
    first = sum(m["reward/rm_score"] for m in history[:2]) / 2
    last = sum(m["reward/rm_score"] for m in history[-3:]) / 3
    assert last > first + 1.0, (first, last)
    assert all(m["kl/ref"] < 8.0 for m in history)  # bounded: far below 8 tokens * log(V) ~ 31 nats
    assert all(math.isfinite(v) for m in history for v in m.values())


def test_first_update_sees_ratio_one_and_metrics_are_complete():
    """Stored logp_old equals the update's forward: at the first minibatch the ratio is exactly 1."""
    trainer = toy_trainer("ppo.ppo_epochs=1", "ppo.minibatch_size=8")  # one update per step
    metrics = trainer.step()
    assert metrics["policy/approx_kl"] < 1e-6
    assert abs(metrics["policy/ratio_mean"] - 1.0) < 1e-5 and metrics["policy/clip_frac"] == 0.0
    assert metrics["lag/engine_logp_gap"] < 1e-5  # the decode loop's log-probs are the trainer's
    expected = {name for name in METRIC_NAMES if not name.startswith(("eval/", "ptx/", "reward/rm_score_used",
                                                                       "reward/eos_penalty", "reward/norm",
                                                                       "reward/clip", "perf/allreduce_mb", "lag/tis_clip_frac",
                                                                       "perf/weight_sync_s"))}
    assert expected <= set(metrics), expected - set(metrics)
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["policy/updates"] == 1 and trainer.policy_version == 1


def test_approx_kl_early_stop_cuts_the_epochs():
    trainer = toy_trainer("ppo.ppo_epochs=4", "ppo.target_approx_kl=1e-9", "ppo.lr=1e-2")
    trainer.step()  # the first step moves the policy; the second's first epoch overshoots the tiny target
    assert trainer.step()["policy/epochs"] == 1
    relaxed = toy_trainer("ppo.ppo_epochs=4")
    relaxed.step()
    assert relaxed.step()["policy/epochs"] == 4


class StaleGenerator:
    """Wraps a generator and stamps its rollouts as sampled ``age`` policy versions ago."""

    def __init__(self, inner, ages):
        self.inner, self.ages, self.calls = inner, list(ages), 0

    def generate(self, prompts, policy_version):
        self.calls += 1
        age = self.ages.pop(0) if self.ages else 99
        return dataclasses.replace(self.inner.generate(prompts, policy_version), policy_version=policy_version - age)


class OffByEngine:
    """Samples like the trainer but reports log-probs shifted by ``shift``, as a mismatched engine would."""

    def __init__(self, inner, shift):
        self.inner, self.shift = inner, shift

    def generate(self, prompts, policy_version):
        rollout = self.inner.generate(prompts, policy_version)
        self.true_logp = rollout.logp_old.clone()
        return dataclasses.replace(rollout, logp_old=rollout.logp_old - self.shift)


def test_truncated_importance_sampling_corrects_an_engine_gap():
    """ppo.tis_cap: the ratio is taken against the trainer's own log-probs (exactly 1 before the update), the
    gap is reported, and tokens are weighted by min(p_trainer / p_engine, cap) = min(e^0.5, 1.5) = 1.5."""
    metrics = {}
    for cap in (None, 1.5):
        trainer = toy_trainer("ppo.ppo_epochs=1", "ppo.minibatch_size=8", *([f"ppo.tis_cap={cap}"] if cap else []))
        trainer.generator = OffByEngine(trainer.generator, shift=0.5)
        metrics[cap] = trainer.step()
    assert metrics[None]["lag/engine_logp_gap"] == pytest.approx(0.5, abs=1e-4)
    assert metrics[None]["policy/ratio_mean"] == pytest.approx(math.exp(0.5), rel=1e-3)  # off-policy ratio
    assert metrics[1.5]["lag/engine_logp_gap"] == pytest.approx(0.5, abs=1e-4)  # still the engine's gap
    assert metrics[1.5]["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # against the trainer's log-probs
    assert metrics[1.5]["lag/tis_clip_frac"] == 1.0  # every weight e^0.5 > 1.5 is capped
    assert "lag/tis_clip_frac" not in metrics[None]


def test_stale_rollouts_are_refused_and_regenerated():
    trainer = toy_trainer("rollout.max_rollout_age=1")
    trainer.generator = StaleGenerator(trainer.generator, [5, 1])  # too old, then acceptable
    metrics = trainer.step()
    assert trainer.generator.calls == 2 and metrics["lag/policy_versions"] == 1
    trainer.generator = StaleGenerator(trainer.generator.inner, [])  # always too old
    with pytest.raises(LmppoError, match="max_rollout_age=1"):
        trainer.step()


def test_ptx_loss_is_logged_when_enabled():
    models = toy_models()
    from lmppo.sft import sft_batch

    demos = [{"prompt": "tell me about the cat", "response": "the cat is good"}] * 4
    trainer = toy_trainer("ppo.ptx_coef=0.5", models=models,
                          ptx_batches=lambda: sft_batch(models.tokenizer, demos))
    metrics = trainer.step()
    assert metrics["ptx/loss"] > 0 and math.isfinite(metrics["ptx/loss"])
    assert "ptx/loss" not in toy_trainer().step()


def test_micro_batch_accumulation_equals_the_full_minibatch():
    """Token-weighted accumulation over micro-batches gives the same update as one pass."""
    weights = []
    for micro in (None, 2, 1):
        overrides = ["ppo.ppo_epochs=1"] + ([f"ppo.micro_batch_size={micro}"] if micro else [])
        trainer = toy_trainer(*overrides, models=toy_models())
        trainer.step()
        weights.append(torch.cat([p.detach().flatten() for p in trainer.policy.parameters()]))
    assert torch.allclose(weights[0], weights[1], atol=1e-6) and torch.allclose(weights[0], weights[2], atol=1e-6)


# --------------------------------------------------------------------------------------------------
# Through the CLI, on models saved to disk
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def run_files(tmp_path):
    """A policy directory, a prompt file and a config for a 2-step run."""
    models = toy_models()
    models.policy.save_pretrained(tmp_path / "policy")
    models.tokenizer.save_pretrained(tmp_path / "policy")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS * 2))
    config = {
        "models": {"policy": {"path": str(tmp_path / "policy")}, "value": {"init_from": "policy"}},
        "reward": {"function": "lmppo.scoring:count_good"},
        "data": {"prompts": str(tmp_path / "prompts.jsonl")},
        "rollout": {"batch_size": 4, "max_new_tokens": 6},
        "ppo": {"minibatch_size": 2, "ppo_epochs": 2, "lr": 1e-3},
        "run": {"output_dir": str(tmp_path / "run"), "steps": 2, "seed": 1},
        "logging": {"quiet": True},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run_cli(*args: str) -> int:
    import sys

    from lmppo.cli import main

    argv, sys.argv = sys.argv, ["lmppo", *args]
    try:
        main()
    except SystemExit as exit_:
        return int(exit_.code or 0)
    finally:
        sys.argv = argv
    return 0


def test_two_step_run_through_the_cli(run_files):
    assert run_cli("ppo", str(run_files)) == 0
    run_dir = run_files.parent / "run"
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    for key in ("reward/rm_score", "reward/kl_penalty", "reward/shaped", "kl/ref", "policy/clip_frac",
                "value/explained_var", "response/eos_frac", "perf/step_s"):
        assert all(math.isfinite(r[key]) for r in records), key
    assert (run_dir / "config.yaml").is_file() and load_config(run_dir / "config.yaml").run.steps == 2
    assert (run_dir / "final" / "config.json").is_file() and (run_dir / "final" / "generation_config.json").is_file()
    card = (run_dir / "final" / "README.md").read_text()
    assert "count_good" in card and "beta" in card
    # Running again into the same directory without --resume would mix two runs: refused.
    assert run_cli("ppo", str(run_files)) == 2


def test_cli_config_errors_exit_2_without_traceback(run_files, capsys):
    assert run_cli("ppo", str(run_files), "ppo.lrr=1") == 2
    err = capsys.readouterr().err
    assert "did you mean 'ppo.lr'" in err and "Traceback" not in err
