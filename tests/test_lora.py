"""LoRA: the reference as the adapter-disabled policy, a frozen copy without it, the decode loop's folded adapters."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import logits

from lmppo.modeling.lora import (
    LoraReference,
    apply_lora,
    inputs_left_to_autocast,
    lora_merged,
    make_reference,
    mergeable_lora_layers,
)
from lmppo.modeling.models import model_identity, trainable_parameters
from lmppo.sampling.hf_engine import hf_generator
from lmppo.sampling.passes import sequence_logprobs


def test_make_reference_without_lora_is_a_frozen_copy(policy_model):
    reference = make_reference(policy_model)
    assert not any(p.requires_grad for p in reference.parameters())
    with torch.no_grad():
        policy_model.lm_head.weight.add_(1.0)
    assert not torch.allclose(logits(reference), logits(policy_model))


def test_lora_reference_is_the_base_and_the_adapter_changes_the_policy_only(policy_model, policy_tokenizer):
    base_copy = copy.deepcopy(policy_model)
    policy = apply_lora(policy_model, r=4, alpha=8, dropout=0.1, target_modules="all-linear")
    reference = make_reference(policy)
    assert isinstance(reference, LoraReference) and not isinstance(reference, torch.nn.Module)
    torch.testing.assert_close(logits(policy), logits(base_copy))  # LoRA B starts at 0
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_()
    policy.eval()
    adapted = logits(policy)
    assert not torch.allclose(adapted, logits(base_copy), atol=1e-3)
    torch.testing.assert_close(logits(reference), logits(base_copy), atol=1e-6, rtol=0)
    torch.testing.assert_close(logits(policy), adapted)  # adapter enabled again after the reference pass

    rollout = hf_generator(policy, policy_tokenizer, max_new_tokens=6).generate(["good cat", "tell me"], 0)
    torch.testing.assert_close(
        sequence_logprobs(reference, rollout), sequence_logprobs(base_copy, rollout), atol=1e-5, rtol=0
    )
    policy.train()
    sequence_logprobs(reference, rollout)
    assert policy.training  # the reference pass ran in eval mode and restored the policy's flag

    trainable = trainable_parameters(policy)
    assert trainable and all("lora_" in name for name, p in policy.named_parameters() if p.requires_grad)
    identity = model_identity("reference", reference, shared_with="policy").to_dict()
    assert identity["trainable_parameters"] == 0 and identity["lora"]["adapter"] == "disabled"
    assert identity["num_parameters"] == model_identity("base", base_copy).num_parameters  # the base weights
    assert model_identity("policy", policy).lora == {**identity["lora"], "adapter": "enabled"}


def test_lora_merged_decodes_like_the_adapter_and_leaves_the_base_untouched(policy_model, policy_tokenizer):
    policy = apply_lora(policy_model, r=4, alpha=8, target_modules="all-linear").eval()
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_()
    base_weights = {n: p.clone() for n, p in policy.named_parameters() if "base_layer" in n}
    flags = {n: p.requires_grad for n, p in policy.named_parameters()}
    adapted = logits(policy)
    assert mergeable_lora_layers(policy)
    with torch.inference_mode(), lora_merged(policy):
        merged = logits(policy)
        assert not any(p.requires_grad for p in policy.parameters())  # nothing to train inside
    torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=0)
    for name, param in policy.named_parameters():
        assert param.requires_grad == flags[name]
        if name in base_weights:
            assert torch.equal(param, base_weights[name])  # bit for bit: the reference's weights
    torch.testing.assert_close(logits(policy), adapted, atol=0, rtol=0)  # the adapter runs again
    with pytest.raises(RuntimeError, match="inference"), lora_merged(policy):
        pass
    # an fp32 base under autocast: the fold would be cast to bf16 at every op, so it is left as it is
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert mergeable_lora_layers(policy) == []
    assert mergeable_lora_layers(policy_model.__class__(policy_model.config)) == []  # no LoRA at all


def test_lora_and_checkpointing_print_no_third_party_deprecation_notes(policy_model):
    """transformers' renaming notes (``is_gradient_checkpointing`` ...) ask nothing of a user: not shown."""
    import warnings

    from lmppo.modeling.models import enable_gradient_checkpointing

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        enable_gradient_checkpointing(apply_lora(policy_model, r=2, alpha=4))
    assert not [w for w in seen if issubclass(w.category, FutureWarning)], [str(w.message) for w in seen]


def test_under_bf16_autocast_lora_inputs_are_not_cast_to_fp32_and_outputs_do_not_change(policy_model):
    """peft casts a LoRA branch's input to the adapter's fp32 and autocast casts it straight back: the
    same bf16 matmul, with two copies of every adapted linear's input fewer."""
    policy_model.to(torch.bfloat16)
    policy = apply_lora(policy_model, r=4, alpha=8, target_modules="all-linear").eval()
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_()
    ids = torch.tensor([[5, 9, 11, 3, 7]])

    def forward_and_copies():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.profiler.profile() as prof:
                out = policy(input_ids=ids).logits
        return out, sum(e.count for e in prof.key_averages() if e.key == "aten::_to_copy")

    cast, copies_cast = forward_and_copies()
    inputs_left_to_autocast(policy)
    left, copies_left = forward_and_copies()
    assert torch.equal(left, cast)
    assert copies_left < copies_cast


def test_a_bf16_base_under_bf16_autocast_folds_within_bf16_rounding(policy_model):
    policy_model.to(torch.bfloat16)
    policy = apply_lora(policy_model, r=4, alpha=8, target_modules="all-linear").eval()
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        adapted = logits(policy).float()
        assert mergeable_lora_layers(policy)
        with lora_merged(policy):
            merged = logits(policy).float()
    assert not torch.equal(merged, adapted)  # rounded once more ...
    torch.testing.assert_close(merged, adapted, atol=0.05, rtol=0.02)  # ... by bf16 steps
    assert mergeable_lora_layers(policy) == []  # a bf16 base outside autocast: the matmuls would mix dtypes
