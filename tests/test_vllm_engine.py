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
from helpers import COUNT_GOOD, POLICY_SPECIALS, POLICY_TEMPLATE, WORDS, build_tokenizer, llama_config
from transformers import LlamaForCausalLM

from lmppo.core import token_logprobs
from lmppo.loading import load_causal_lm, load_tokenizer
from lmppo.lora import apply_lora
from lmppo.metrics import read_metrics
from lmppo.rollout import HFGenerator, response_logits
from lmppo.vllm_engine import policy_weights

PROMPTS = ["tell me about the cat", "write a short poem", "tell me a story", "the day was very happy"]
TOLERANCE = 1e-4


def test_policy_weights_fold_lora_in_without_touching_the_model():
    tokenizer = build_tokenizer(
        POLICY_SPECIALS, list(WORDS), pad="<pad>", eos="</s>", bos="<s>", chat_template=POLICY_TEMPLATE
    )
    torch.manual_seed(0)
    base = LlamaForCausalLM(llama_config(tokenizer))
    expected_names = set(base.state_dict())
    policy = apply_lora(base, r=2, alpha=4, target_modules="all-linear")
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_()
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    weights = policy_weights(policy)
    assert set(weights) == expected_names  # transformers checkpoint names, no adapter tensors
    assert all(torch.equal(v, policy.state_dict()[k]) for k, v in before.items())  # model unchanged
    merged = policy.merge_and_unload().state_dict()
    assert all(torch.allclose(weights[k], merged[k], atol=1e-6) for k in expected_names)


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
    from lmppo.vllm_engine import VLLMGenerator

    policy, tokenizer = load_causal_lm(tiny_dir), load_tokenizer(tiny_dir)
    generator = VLLMGenerator(policy, tokenizer, tiny_dir, max_new_tokens=12, temperature=0.7, seed=0)
    yield policy, tokenizer, generator
    del generator.engine
    gc.collect()


@pytest.mark.vllm
def test_the_transformers_decode_loop_uses_its_cache_under_this_environments_transformers(tiny_dir):
    """vLLM pins an older transformers, whose forward names the cache ``past_key_values``: the decode loop must
    pass it under that name, or every step would see one token and no context."""
    policy, tokenizer = load_causal_lm(tiny_dir), load_tokenizer(tiny_dir)
    torch.manual_seed(0)
    rollout = HFGenerator(policy, tokenizer, max_new_tokens=12, temperature=0.7).generate(
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
    assert rollout.policy_version == generator.synced_version == 0  # the engine's version, not the caller's
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
def test_a_ppo_step_syncs_the_engine_to_the_new_weights(engine):
    from helpers import toy_trainer

    from lmppo.lora import make_reference
    from lmppo.models import PPOModels, ValueModel
    from lmppo.scoring import load_reward_function

    policy, tokenizer, generator = engine
    models = PPOModels(
        policy,
        make_reference(policy),
        ValueModel.from_causal_lm(policy),
        tokenizer,
        load_reward_function(COUNT_GOOD),
    )
    sequence = generator.render(PROMPTS[0]) + tokenizer.convert_tokens_to_ids(["the", "cat", "is", "happy"])
    before = generator.sequence_logprobs([sequence])[0]
    trainer = toy_trainer("ppo.lr=1e-2", models=models, generator=generator)
    metrics = trainer.step()
    assert trainer.policy_version == generator.synced_version == 1
    assert metrics["perf/weight_sync_s"] > 0 and metrics["engine/logp_gap"] < TOLERANCE
    after = generator.sequence_logprobs([sequence])[0]
    assert (after - before).abs().max() > 100 * TOLERANCE  # the weights moved
    torch.testing.assert_close(after, trainer_logprobs(policy, sequence), atol=TOLERANCE, rtol=0)
    assert math.isfinite(metrics["policy/loss"])


@pytest.mark.vllm
def test_lora_weight_sync_serves_each_new_adapter_and_keeps_the_base_weights(tiny_dir):
    """weight_sync="lora": the engine keeps the base weights and serves the adapter saved at each sync, so
    after every sync its log-probs are the LoRA policy's (two syncs: the second adapter replaces the first)."""
    pytest.importorskip("vllm")
    from lmppo.vllm_engine import VLLMGenerator

    tokenizer = load_tokenizer(tiny_dir)
    policy = apply_lora(load_causal_lm(tiny_dir), r=4, alpha=8, target_modules="all-linear")
    generator = VLLMGenerator(
        policy, tokenizer, tiny_dir, max_new_tokens=12, temperature=0.7, weight_sync="lora"
    )
    sequence = generator.render(PROMPTS[0]) + tokenizer.convert_tokens_to_ids(["the", "cat", "is", "happy"])
    base = generator.sequence_logprobs([sequence])[0]  # a fresh adapter is zero: the base weights serve
    torch.testing.assert_close(base, trainer_logprobs(policy, sequence), atol=TOLERANCE, rtol=0)
    for version in (1, 2):
        with torch.no_grad():
            for name, param in policy.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.5)
        generator.sync_weights(policy, version)
        served = generator.sequence_logprobs([sequence])[0]
        assert generator.synced_version == version and (served - base).abs().max() > 100 * TOLERANCE
        torch.testing.assert_close(served, trainer_logprobs(policy, sequence), atol=TOLERANCE, rtol=0)
    rollout = generator.generate(PROMPTS * 2, policy_version=2)
    mask = rollout.response_mask.bool()
    assert (teacher_forced(policy, rollout) - rollout.logp_old)[mask].abs().max() < TOLERANCE  # sampling too
    del generator.engine
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
        "run": {"output_dir": str(tmp_path / "run"), "steps": 3, "seed": 1},
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
