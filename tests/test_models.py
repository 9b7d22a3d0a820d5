"""Model loading, freezing, LoRA reference, value model variants and identity records."""

from __future__ import annotations

import copy
import json
import resource
import sys

import numpy as np
import pytest
import torch
from peft import PeftModel

from lmppo.config import ModelSource, validate_config
from lmppo.errors import LmppoError
from lmppo.models import (
    LoraReference,
    ValueModel,
    apply_lora,
    eval_mode,
    freeze,
    keep_freed_heap_memory,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    lora_merged,
    make_reference,
    mergeable_lora_layers,
    model_identity,
    resolve_source,
    trainable_parameters,
)
from lmppo.rollout import HFGenerator, sequence_logprobs

INPUT_IDS = torch.tensor([[1, 3, 7, 9, 12, 4, 20], [1, 3, 8, 8, 30, 4, 22]])


def logits(model, input_ids=INPUT_IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids).logits


@pytest.fixture
def saved_policy(tmp_path, policy_model, policy_tokenizer):
    policy_model.save_pretrained(tmp_path / "policy")
    policy_tokenizer.save_pretrained(tmp_path / "policy")
    return tmp_path / "policy"


def test_load_from_directory_with_dtype_and_identity(saved_policy, policy_model, policy_tokenizer):
    model = load_causal_lm(saved_policy)
    tokenizer = load_tokenizer(saved_policy)
    torch.testing.assert_close(logits(model), logits(policy_model))
    assert tokenizer.chat_template == policy_tokenizer.chat_template
    assert load_causal_lm(ModelSource(path=str(saved_policy), dtype="bfloat16")).dtype == torch.bfloat16

    source = resolve_source(saved_policy)
    identity = model_identity("policy", model, source=source, tokenizer=tokenizer)
    record = json.loads(json.dumps(identity.to_dict()))  # JSON-ready for the checkpoint manifest
    assert (
        record["role"] == "policy" and record["source"] == str(saved_policy) and record["dtype"] == "float32"
    )
    assert (
        record["num_parameters"]
        == record["trainable_parameters"]
        == sum(p.numel() for p in model.parameters())
    )
    assert record["lora"] is None and record["shared_with"] is None
    again = model_identity(
        "policy", load_causal_lm(saved_policy), source=source, tokenizer=load_tokenizer(saved_policy)
    )
    assert again == identity  # deterministic

    other_template = model_identity(
        "policy", model, source=source, tokenizer=tokenizer, chat_template="{{ x }}"
    )
    assert other_template.chat_template_sha256 != identity.chat_template_sha256
    assert other_template.tokenizer_sha256 == identity.tokenizer_sha256
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    model.save_pretrained(saved_policy)
    assert model_identity("policy", model, source=source).weights_sha256 != identity.weights_sha256


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(LmppoError, match="does not exist.*never downloads"):
        load_causal_lm(tmp_path / "nowhere")
    with pytest.raises(LmppoError, match="not in the local Hugging Face cache"):
        load_tokenizer("nobody-here/no-such-model")  # a hub id that is not on disk: no download attempted
    (tmp_path / "empty").mkdir()
    with pytest.raises(LmppoError, match="cannot load a causal LM"):
        load_causal_lm(tmp_path / "empty")
    with pytest.raises(LmppoError, match="dtype"):  # the model section checks the name
        validate_config({"path": str(tmp_path / "empty"), "dtype": "float8"}, schema=ModelSource)


def test_gguf_file_without_tokenizer_is_a_clear_error(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "weights-only.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(32)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((10, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(LmppoError, match="no usable tokenizer"):
        load_tokenizer(path)
    with pytest.raises(LmppoError, match="not found"):
        load_tokenizer(ModelSource(path=str(tmp_path), gguf_file="other.gguf"))


def test_reward_model_loads_frozen_and_needs_a_score_head(
    tmp_path, saved_policy, make_reward_model, policy_tokenizer
):
    with pytest.raises(LmppoError, match="no trained score head"):
        load_reward_model(saved_policy)  # a causal LM would get a random head silently
    make_reward_model(policy_tokenizer).save_pretrained(tmp_path / "rm")
    reward_model = load_reward_model(tmp_path / "rm")
    assert not reward_model.training
    assert not any(p.requires_grad for p in reward_model.parameters())


def test_freeze_and_eval_mode(policy_model, make_causal_lm, policy_tokenizer):
    frozen = freeze(make_causal_lm(policy_tokenizer).train())
    assert not frozen.training and not any(p.requires_grad for p in frozen.parameters())
    policy_model.train()
    with pytest.raises(RuntimeError), eval_mode(policy_model, frozen):
        assert not policy_model.training
        raise RuntimeError
    assert policy_model.training and not frozen.training  # each flag restored, also after an error


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

    rollout = HFGenerator(policy, policy_tokenizer, max_new_tokens=6).generate(["good cat", "tell me"], 0)
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
    # a 16-bit base, or autocast, would round the adapter's small update away: left as it is
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert mergeable_lora_layers(policy) == []
    assert mergeable_lora_layers(policy_model.__class__(policy_model.config)) == []  # no LoRA at all


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
        apply_lora(value_model, r=2, alpha=4)
    assert model_identity("value", value_model, shared_with="policy").shared_with == "policy"


def test_lora_on_a_separate_value_model(make_reward_model, policy_tokenizer):
    value_model = apply_lora(ValueModel.from_reward_model(make_reward_model(policy_tokenizer)), r=4, alpha=8)
    assert isinstance(value_model.backbone, PeftModel)
    trainable = {name for name, p in value_model.named_parameters() if p.requires_grad}
    assert "head.weight" in trainable and all("lora_" in n or n.startswith("head") for n in trainable)
    mask = torch.ones_like(INPUT_IDS)
    values = value_model(INPUT_IDS, mask, torch.arange(INPUT_IDS.shape[1]).expand_as(INPUT_IDS))
    values.sum().backward()
    assert value_model.head.weight.grad is not None
    assert model_identity("value", value_model).lora["r"] == 4


def test_damaged_or_unsafe_weights_and_wrong_kinds_of_model_are_named(
    tmp_path, saved_policy, make_reward_model, policy_tokenizer
):
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    for file in saved_policy.iterdir():
        (truncated / file.name).write_bytes(file.read_bytes())
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(LmppoError, match="cannot load a causal LM from .*truncated"):
        load_causal_lm(truncated)

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((saved_policy / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"not even a pickle")
    with pytest.raises(
        LmppoError, match=r"only pickled weights \(pytorch_model.bin\): lmppo loads safetensors only"
    ):
        load_causal_lm(pickled)

    two_labels = make_reward_model(policy_tokenizer)
    two_labels.config.num_labels = 2  # its config now says 2 outputs, as a classifier's would
    two_labels.save_pretrained(tmp_path / "two_labels")
    with pytest.raises(LmppoError, match="2 outputs; a reward model needs one scalar"):
        load_reward_model(tmp_path / "two_labels")

    (tmp_path / "prompts.jsonl").write_text('{"prompt": "hi"}\n')
    with pytest.raises(LmppoError, match="is a file, not a model"):
        load_causal_lm(tmp_path / "prompts.jsonl")


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
