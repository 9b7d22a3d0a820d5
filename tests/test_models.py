"""Models once loaded: freezing and eval mode, the value model's variants, identity records, the heap's tuning."""

from __future__ import annotations

import resource
import sys

import pytest
import torch
from helpers import INPUT_IDS
from peft import PeftModel

from lmppo.errors import LmppoError
from lmppo.inputs.config import LoraConfig
from lmppo.modeling.loading import freeze
from lmppo.modeling.lora import apply_lora
from lmppo.modeling.models import (
    ValueModel,
    eval_mode,
    keep_freed_heap_memory,
    model_identity,
    trainable_parameters,
)


def test_freeze_and_eval_mode(policy_model, make_causal_lm, policy_tokenizer):
    frozen = freeze(make_causal_lm(policy_tokenizer).train())
    assert not frozen.training and not any(p.requires_grad for p in frozen.parameters())
    policy_model.train()
    with pytest.raises(RuntimeError), eval_mode(policy_model, frozen):
        assert not policy_model.training
        raise RuntimeError
    assert policy_model.training and not frozen.training  # each flag restored, also after an error


def test_value_model_from_reward_model_is_a_trainable_copy(make_reward_model, policy_tokenizer):
    reward_model = freeze(make_reward_model(policy_tokenizer))
    value_model = ValueModel.from_reward_model(reward_model)
    assert torch.equal(value_model.head.weight, reward_model.score.weight)
    assert value_model.head.weight.data_ptr() != reward_model.score.weight.data_ptr()
    assert all(p.requires_grad for p in value_model.parameters())
    assert not any(p.requires_grad for p in reward_model.parameters())
    mask = torch.ones_like(INPUT_IDS)
    positions = torch.arange(INPUT_IDS.shape[1]).expand_as(INPUT_IDS)
    values = value_model(INPUT_IDS, mask, positions)
    assert values.shape == INPUT_IDS.shape and values.dtype == torch.float32
    with torch.no_grad():
        reward_model.config.pad_token_id = None  # pool at the last position
        torch.testing.assert_close(values[:1, -1], reward_model(input_ids=INPUT_IDS[:1]).logits[:, 0])


def test_value_model_from_causal_lm_starts_at_zero(policy_model):
    value_model = ValueModel.from_causal_lm(policy_model)
    mask = torch.ones_like(INPUT_IDS)
    values = value_model(INPUT_IDS, mask, torch.arange(INPUT_IDS.shape[1]).expand_as(INPUT_IDS))
    assert torch.equal(values, torch.zeros_like(values, dtype=torch.float32))
    policy_params = {id(p) for p in policy_model.parameters()}
    assert not any(id(p) in policy_params for p in value_model.parameters())  # a separate network


def test_value_model_from_a_lora_policy_copies_the_base_without_adapter_layers(policy_model):
    base_hidden = policy_model.model(input_ids=INPUT_IDS).last_hidden_state
    policy = apply_lora(policy_model, r=2, alpha=4)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_()
    for source in (policy, policy.get_base_model()):  # the peft wrapper, or the base with injected layers
        value_model = ValueModel.from_causal_lm(source)
        assert not any("lora" in name for name, _ in value_model.named_parameters())
        assert all(p.requires_grad for p in value_model.parameters())
        hidden = value_model.backbone(input_ids=INPUT_IDS).last_hidden_state
        torch.testing.assert_close(hidden, base_hidden)
    assert any("lora" in name for name, _ in policy.named_parameters())  # the policy keeps its adapter


def test_shared_trunk_value_model_shares_the_policy_backbone(policy_model):
    policy = apply_lora(policy_model, r=2, alpha=4)
    value_model = ValueModel.shared_trunk(policy)
    backbone_params = {id(p) for p in policy.parameters()}
    assert all(id(p) in backbone_params for p in value_model.backbone.parameters())
    params = trainable_parameters(policy, value_model)
    assert len(params) == len({id(p) for p in params})  # the shared trunk once: one optimizer, no duplicates
    assert len(params) == len(trainable_parameters(policy)) + 2  # + head weight and bias
    with pytest.raises(LmppoError, match="through the policy"):
        value_model.with_lora(LoraConfig(enabled=True, r=2, alpha=4))
    assert model_identity("value", value_model, shared_with="policy").shared_with == "policy"


def test_lora_on_a_separate_value_model(make_reward_model, policy_tokenizer):
    value_model = ValueModel.from_reward_model(make_reward_model(policy_tokenizer))
    value_model.with_lora(LoraConfig(enabled=True, r=4, alpha=8))
    assert isinstance(value_model.backbone, PeftModel)
    trainable = {name for name, p in value_model.named_parameters() if p.requires_grad}
    assert "head.weight" in trainable and all("lora_" in n or n.startswith("head") for n in trainable)
    mask = torch.ones_like(INPUT_IDS)
    values = value_model(INPUT_IDS, mask, torch.arange(INPUT_IDS.shape[1]).expand_as(INPUT_IDS))
    values.sum().backward()
    assert value_model.head.weight.grad is not None
    assert model_identity("value", value_model).lora["r"] == 4


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's allocator")
def test_freed_heap_memory_is_reused_without_page_faults():
    assert keep_freed_heap_memory()
    words = 64 * 2**20 // 4  # 64 MiB: 16,384 pages, each faulted again if it went back to the kernel
    for _ in range(2):  # the heap grows to hold it (glibc's default would unmap it on every free)
        torch.ones(words).sum()
    refaulted = []  # pytest's own allocations can land between two of ours: the steady state is the least
    for _ in range(3):
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.ones(words).sum()
        refaulted.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
    assert min(refaulted) < 1000, refaulted
