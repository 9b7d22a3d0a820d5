"""rollout.engine: vllm. The engine tests run in .venv-vllm (`make test-vllm`); elsewhere they skip.

Tolerances: fp32 on both sides; vLLM's CPU kernels and transformers' eager forward differ by float
rounding only, so per-token log-probs agree to 1e-4.
"""

import gc
import json
import math
import subprocess
import sys

import pytest
import torch
import yaml
from helpers import (
    COUNT_GOOD,
    LOSES_RANK1,
    POLICY_SPECIALS,
    POLICY_TEMPLATE,
    WORDS,
    build_tokenizer,
    comparable,
    llama_config,
    torchrun,
)
from transformers import LlamaForCausalLM

from lmppo.math.core import token_logprobs
from lmppo.modeling.loading import load_causal_lm, load_tokenizer
from lmppo.modeling.lora import apply_lora
from lmppo.sampling.hf_engine import hf_generator
from lmppo.sampling.passes import response_logits
from lmppo.training.metrics import read_metrics

PROMPTS = ["tell me about the cat", "write a short poem", "tell me a story", "the day was very happy"]
TOLERANCE = 1e-4


# --------------------------------------------------------------------------------------------------
# On the engine (vllm installed)
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny Llama with head_dim 64 (vLLM's CPU attention kernels need a supported head size)."""
    tokenizer = build_tokenizer(
        POLICY_SPECIALS, list(WORDS), pad="<pad>", eos="</s>", bos="<s>", chat_template=POLICY_TEMPLATE
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        llama_config(
            tokenizer, hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2
        )
    )
    directory = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def engine(tiny_dir):
    """One engine for the module: start-up takes seconds."""
    pytest.importorskip("vllm")
    from lmppo.sampling.vllm_engine import vllm_generator

    policy, tokenizer = load_causal_lm(tiny_dir), load_tokenizer(tiny_dir)
    generator = vllm_generator(policy, tokenizer, tiny_dir, max_new_tokens=12, temperature=0.7, seed=0)
    yield policy, tokenizer, generator
    del generator.engine.llm
    gc.collect()


@pytest.mark.vllm
def test_the_transformers_decode_loop_uses_its_cache_under_this_environments_transformers(tiny_dir):
    """vLLM pins an older transformers, whose forward names the cache ``past_key_values``: the decode loop must
    pass it under that name, or every step would see one token and no context."""
    policy, tokenizer = load_causal_lm(tiny_dir), load_tokenizer(tiny_dir)
    torch.manual_seed(0)
    rollout = hf_generator(policy, tokenizer, max_new_tokens=12, temperature=0.7).generate(
        PROMPTS, policy_version=0
    )
    mask = rollout.response_mask.bool()
    assert (teacher_forced(policy, rollout) - rollout.logp_old)[mask].abs().max() < 1e-5


def teacher_forced(policy, rollout):
    with torch.no_grad():
        return token_logprobs(response_logits(policy, rollout), rollout.response_ids)


@pytest.mark.vllm
def test_engine_rollout_masks_termination_and_logprobs_match_the_trainer(engine):
    policy, tokenizer, generator = engine
    rollout = generator.generate(PROMPTS * 4, policy_version=7)
    assert (
        rollout.policy_version == generator.engine.synced_version == 0
    )  # the engine's version, not the caller's
    eos = tokenizer.eos_token_id
    for b in range(len(rollout)):
        ids, n = rollout.response_ids[b], int(rollout.response_mask[b].sum())
        assert rollout.response_mask[b, :n].all() and not rollout.response_mask[b, n:].any()
        if rollout.terminated[b]:
            assert ids[n - 1] == eos and not (ids[: n - 1] == eos).any()
        else:
            assert n == 12 and not (ids == eos).any()
    mask = rollout.response_mask.bool()
    gap = (teacher_forced(policy, rollout) - rollout.logp_old)[mask].abs().max().item()
    assert gap < TOLERANCE, f"engine log-probs (tempered) differ from the trainer's by {gap:.2e}"


@pytest.mark.vllm
def test_episodes_on_the_engine_keep_its_log_probs_at_the_actions(engine):
    """Multi-turn episodes sampled turn by turn on vLLM (prompt token ids each turn, prefix caching): every
    action's log-prob is the trainer's at that position of the whole sequence, context and all."""
    from sample_environments import AnswerTwice

    from lmppo.sampling.episodes import EpisodeGenerator

    policy, tokenizer, generator = engine
    episodes = EpisodeGenerator(
        generator.engine,
        generator.renderer,
        AnswerTwice,
        name="tests",
        max_turns=3,
        max_total_tokens=48,
        seed=0,
    )
    rollout = episodes.generate(PROMPTS * 4, policy_version=7)
    assert rollout.policy_version == generator.engine.synced_version  # the engine's version
    assert rollout.episode.context_mask.sum() > 0 and (rollout.episode.counts["turns"] > 1).any()
    actions = rollout.action_mask.bool()
    gap = (teacher_forced(policy, rollout) - rollout.logp_old)[actions].abs().max().item()
    assert gap < TOLERANCE, f"engine log-probs at the actions differ from the trainer's by {gap:.2e}"


@pytest.mark.vllm
def test_a_ppo_step_syncs_the_engine_to_the_new_weights(engine, tiny_dir):
    from helpers import toy_trainer

    from lmppo.modeling.lora import make_reference
    from lmppo.modeling.models import PPOModels, ValueModel
    from lmppo.rewards.scoring import load_reward_function

    policy, tokenizer, generator = engine
    models = PPOModels(
        policy,
        make_reference(policy),
        ValueModel.from_causal_lm(policy),
        tokenizer,
        load_reward_function(COUNT_GOOD),
    )
    sequence = generator.renderer.render(PROMPTS[0]) + tokenizer.convert_tokens_to_ids(
        ["the", "cat", "is", "happy"]
    )
    before = generator.engine.prompt_logprobs([sequence])[0]
    # the run's spec says the engine is vLLM's, which holds its own weights: the trainer syncs it
    engine_is_vllm = ("rollout.engine=vllm", f"models.policy.path={tiny_dir}")
    trainer = toy_trainer("ppo.lr=1e-2", *engine_is_vllm, models=models, generator=generator)
    metrics = trainer.step()
    assert trainer.policy_version == generator.engine.synced_version == 1
    assert metrics["perf/weight_sync_s"] > 0 and metrics["engine/logp_gap"] < TOLERANCE
    after = generator.engine.prompt_logprobs([sequence])[0]
    assert (after - before).abs().max() > 100 * TOLERANCE  # the weights moved
    torch.testing.assert_close(after, trainer_logprobs(policy, sequence), atol=TOLERANCE, rtol=0)
    assert math.isfinite(metrics["policy/loss"])


@pytest.mark.vllm
def test_lora_weight_sync_serves_each_new_adapter_and_keeps_the_base_weights(tiny_dir):
    """weight_sync="lora": the engine keeps the base weights and serves the adapter saved at each sync, so
    after every sync its log-probs are the LoRA policy's (two syncs: the second adapter replaces the first)."""
    pytest.importorskip("vllm")
    from lmppo.sampling.vllm_engine import vllm_generator

    tokenizer = load_tokenizer(tiny_dir)
    policy = apply_lora(load_causal_lm(tiny_dir), r=4, alpha=8, target_modules="all-linear")
    generator = vllm_generator(
        policy, tokenizer, tiny_dir, max_new_tokens=12, temperature=0.7, weight_sync="lora"
    )
    sequence = generator.renderer.render(PROMPTS[0]) + tokenizer.convert_tokens_to_ids(
        ["the", "cat", "is", "happy"]
    )
    base = generator.engine.prompt_logprobs([sequence])[0]  # a fresh adapter is zero: the base weights serve
    torch.testing.assert_close(base, trainer_logprobs(policy, sequence), atol=TOLERANCE, rtol=0)
    for version in (1, 2):
        with torch.no_grad():
            for name, param in policy.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.5)
        generator.sync_weights(policy, version)
        served = generator.engine.prompt_logprobs([sequence])[0]
        assert generator.engine.synced_version == version and (served - base).abs().max() > 100 * TOLERANCE
        torch.testing.assert_close(served, trainer_logprobs(policy, sequence), atol=TOLERANCE, rtol=0)
    rollout = generator.generate(PROMPTS * 2, policy_version=2)
    mask = rollout.response_mask.bool()
    assert (teacher_forced(policy, rollout) - rollout.logp_old)[mask].abs().max() < TOLERANCE  # sampling too
    del generator.engine.llm
    gc.collect()


def trainer_logprobs(policy, sequence):
    with torch.no_grad():
        logits = policy(input_ids=torch.tensor([sequence])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(sequence[1:])[:, None]).squeeze(1)


@pytest.mark.vllm
@pytest.mark.slow
def test_three_ppo_steps_with_engine_vllm_through_the_cli(tiny_dir, tmp_path):
    pytest.importorskip("vllm")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS * 2))
    config = {
        "models": {"policy": {"path": str(tiny_dir)}, "value": {"init_from": "policy"}},
        "reward": {"function": COUNT_GOOD},
        "data": {"prompts": str(tmp_path / "prompts.jsonl")},
        "rollout": {"engine": "vllm", "batch_size": 4, "max_new_tokens": 8},
        "ppo": {"minibatch_size": 2, "ppo_epochs": 2, "lr": 1e-3},
        "run": {"output_dir": str(tmp_path / "run"), "steps": 3, "seed": 1, "precision": "fp32"},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [sys.executable, "-m", "lmppo", "ppo", str(tmp_path / "config.yaml"), "--quiet"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    start, *records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in [start, *records]] == [0, 1, 2, 3]  # 0: the reward pre-flight
    assert "preflight/rm_score_mean" in start
    assert all(r["perf/weight_sync_s"] > 0 and r["lag/policy_versions"] == 0 for r in records)
    assert all(r["engine/logp_gap"] < TOLERANCE for r in records)  # synced before every rollout
    assert (tmp_path / "run" / "final" / "config.json").is_file()


# --------------------------------------------------------------------------------------------------
# Under torchrun, one-step-off, evaluation: runs through the CLI
# --------------------------------------------------------------------------------------------------


def engine_run_config(tiny_dir, tmp_path, name: str, **sections) -> str:
    """A 3-step run on the engine; one minibatch per step, so a step's update does not depend on how the
    rows are shuffled on each rank."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS * 2))
    config = {
        "models": {"policy": {"path": str(tiny_dir)}, "value": {"init_from": "policy"}},
        "reward": {"function": COUNT_GOOD},
        "data": {"prompts": str(prompts)},
        "rollout": {"engine": "vllm", "batch_size": 4, "max_new_tokens": 8},
        "ppo": {"minibatch_size": 4, "ppo_epochs": 1, "lr": 1e-3},
        "run": {
            "output_dir": str(tmp_path / name),
            "steps": 3,
            "seed": 1,
            "checkpoint_every": 1,
            "precision": "fp32",
        },
    }
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def lmppo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lmppo", *args], capture_output=True, text=True, timeout=600, check=False
    )


def assert_same_records(a, b, rel=1e-4):
    """Equal up to float rounding (the ranks' gradient all-reduce sums in another order). The absolute
    tolerance is for ``policy/ratio_std``: the square root of a difference of two means close to 1."""
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(comparable(a), comparable(b)):
        assert x.keys() == y.keys()
        differ = {k: (x[k], y[k]) for k in x if x[k] != pytest.approx(y[k], rel=rel, abs=3e-4)}
        assert not differ, f"step {x['step']}: {differ}"


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.distributed
def test_an_engine_on_each_of_two_ranks_samples_and_steps_as_one_process_and_resumes_exactly(
    tiny_dir, tmp_path
):
    """Each rank drives its own engine and samples its share; every sample is seeded by its place in the
    prompt stream, so 2 ranks draw the same responses as 1 process: same rewards, log-probs and update."""
    assert lmppo("ppo", engine_run_config(tiny_dir, tmp_path, "alone"), "--quiet").returncode == 0
    done = torchrun(engine_run_config(tiny_dir, tmp_path, "two"))
    assert done.returncode == 0, done.stderr[-3000:]
    alone, two = read_metrics(tmp_path / "alone"), read_metrics(tmp_path / "two")
    assert_same_records(alone, two)
    assert all(r["engine/logp_gap"] < TOLERANCE and r["perf/weight_sync_s"] > 0 for r in two[1:])
    # exact resume on 2 ranks: stop after step 2, continue to 3
    split = engine_run_config(tiny_dir, tmp_path, "split", run={"steps": 2})
    assert torchrun(split).returncode == 0
    done = torchrun("--resume", str(tmp_path / "split"), "run.steps=3")
    assert done.returncode == 0, done.stderr[-3000:]
    assert comparable(read_metrics(tmp_path / "split")) == comparable(two)


@pytest.mark.vllm
@pytest.mark.slow
def test_one_step_off_rollouts_on_the_engine_lag_one_version_and_resume_exactly(tiny_dir, tmp_path):
    """rollout.asynchronous: the engine samples step k+1 during step k's update, with the weights before
    it; the batch in flight at a checkpoint is saved with it, so a resumed run continues exactly."""
    asynchronous = {"asynchronous": True, "engine": "vllm", "batch_size": 4, "max_new_tokens": 8}
    config = engine_run_config(tiny_dir, tmp_path, "straight", rollout=asynchronous, run={"steps": 4})
    done = lmppo("ppo", config, "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    straight = read_metrics(tmp_path / "straight")
    assert [r["lag/policy_versions"] for r in straight[1:]] == [0, 1, 1, 1]
    assert all(r["engine/logp_gap"] > TOLERANCE for r in straight[2:])  # sampled by the previous weights
    split = engine_run_config(tiny_dir, tmp_path, "split", rollout=asynchronous, run={"steps": 2})
    assert lmppo("ppo", split, "--quiet").returncode == 0
    assert lmppo("ppo", "--resume", str(tmp_path / "split"), "run.steps=4", "--quiet").returncode == 0
    assert comparable(read_metrics(tmp_path / "split")) == comparable(straight)


@pytest.mark.vllm
@pytest.mark.slow
def test_evaluation_samples_on_the_runs_engine_in_the_run_and_in_lmppo_eval(tiny_dir, tmp_path):
    """In-run evaluation and `lmppo eval` both sample on the engine with each held-out prompt's seed: the
    starting policy's step-0 evaluation and `lmppo eval`'s "start" are the same responses."""
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": p + " again"}) + "\n" for p in PROMPTS))
    config = engine_run_config(
        tiny_dir, tmp_path, "run", data={"eval_prompts": str(held_out)}, run={"steps": 2, "eval_every": 1}
    )
    assert lmppo("ppo", config, "--quiet").returncode == 0
    done = lmppo("eval", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr[-3000:]
    start = json.loads((tmp_path / "run" / "eval.json").read_text())["policies"]["start"]["metrics"]
    step0 = read_metrics(tmp_path / "run")[0]
    for key in ("eval/reward/rm_score", "eval/response/length"):
        assert step0[key] == pytest.approx(start[key], abs=1e-6), key


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.distributed
def test_a_lost_rank_still_ends_a_job_with_engines(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LOST_RANK_MARKER", str(tmp_path / "rank1-died"))
    config = engine_run_config(
        tiny_dir, tmp_path, "killed", reward={"function": LOSES_RANK1}, distributed={"timeout_s": 30}
    )
    done = torchrun(config)
    assert done.returncode != 0 and "rank 0 lost rank 1" in done.stderr, done.stderr[-3000:]
