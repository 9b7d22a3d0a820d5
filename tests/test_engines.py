"""Engines with their own copy of the policy: the weight stream and the snapshot engine.
One-step-off rollouts through the trainer are in test_trainer.py and test_run.py; vLLM in test_vllm_engine.py."""

import torch
from helpers import POLICY_SPECIALS, POLICY_TEMPLATE, WORDS, build_tokenizer, llama_config
from transformers import LlamaForCausalLM

from lmppo.modeling.lora import apply_lora
from lmppo.sampling.engines import Samples, policy_weights, sampling_parts
from lmppo.sampling.responses import ResponseGenerator


def policy_tokenizer():
    return build_tokenizer(
        POLICY_SPECIALS, list(WORDS), pad="<pad>", eos="</s>", bos="<s>", chat_template=POLICY_TEMPLATE
    )


def test_policy_weights_fold_lora_in_without_touching_the_model():
    tokenizer = policy_tokenizer()
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


class OwnWeightsEngine:
    """An engine sampling from its own weights (as vLLM does): it records what the trained module looks
    like while it samples and returns a fixed response."""

    owns_weights, decode_budget, device, pad_token_id = True, None, torch.device("cpu"), 0
    memory_remedy = "none"

    def __init__(self, policy, settings):
        self.model, self.settings = policy, settings

    def sample(self, query_ids, query_mask, sample_ids, max_new_tokens=None, turn=0):
        lora_layer = self.model.base_model.model.model.layers[0].self_attn.q_proj
        self.seen = (self.model.training, lora_layer.base_layer.weight, lora_layer.disable_adapters)
        response = torch.full((len(sample_ids), 2), self.settings.stop_token_ids[0])
        return Samples(response, torch.zeros(response.shape))

    def version_sampled(self, policy_version):
        return 0

    def sleep(self):
        pass


def test_an_engine_with_its_own_weights_leaves_the_trained_module_alone_while_it_samples():
    """With rollout.asynchronous an engine samples on a worker thread while the update trains the policy:
    the transformers loop's LoRA fold (a swapped-in base weight) and eval mode must not reach it."""
    tokenizer = policy_tokenizer()
    policy = apply_lora(LlamaForCausalLM(llama_config(tokenizer)), r=2, alpha=4).train()
    base_weight = policy.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    settings, renderer = sampling_parts(policy, tokenizer, max_new_tokens=2)
    engine = OwnWeightsEngine(policy, settings)
    ResponseGenerator(engine, renderer).generate([[{"role": "user", "content": "a b"}]], policy_version=0)
    training, weight_while_sampling, adapters_off = engine.seen
    assert training and weight_while_sampling is base_weight and not adapters_off
