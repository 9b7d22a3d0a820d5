"""Engines with their own copy of the policy: the weight stream and the snapshot engine.
One-step-off rollouts through the trainer are in test_trainer.py and test_run.py; vLLM in test_vllm_engine.py."""

import torch
from helpers import POLICY_SPECIALS, POLICY_TEMPLATE, WORDS, build_tokenizer, llama_config
from transformers import LlamaForCausalLM

from lmppo.engines import policy_weights
from lmppo.lora import apply_lora


def test_policy_weights_fold_lora_in_without_touching_the_model():
    tokenizer = build_tokenizer(
        POLICY_SPECIALS, list(WORDS), pad="<pad>", eos="</s>", bos="<s>", chat_template=POLICY_TEMPLATE
    )
    torch.manual_seed(0)
    base = LlamaForCausalLM(llama_config(tokenizer))
    expected_names = {name for name, _ in base.named_parameters()}
    policy = apply_lora(base, r=2, alpha=4, target_modules="all-linear")
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_()
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    weights = dict(policy_weights(policy))
    assert set(weights) == expected_names  # transformers checkpoint names, no adapter tensors
    assert all(torch.equal(v, policy.state_dict()[k]) for k, v in before.items())  # model unchanged
    merged = policy.merge_and_unload().state_dict()
    assert all(torch.allclose(weights[k], merged[k], atol=1e-6) for k in expected_names)
