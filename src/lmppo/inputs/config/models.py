"""The ``models`` section: the trained policy, its frozen reference and the critic; and the two sections
that recur wherever a model is named (``ModelSource``, ``LoraConfig``: the reward's models, a supervised
stage's)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from lmppo.inputs.config.section import Dtype, Section


class LoraConfig(Section):
    """LoRA adapters (peft) on a trained model; ``enabled: false`` trains all weights."""

    enabled: bool = Field(False, description="train LoRA adapters instead of every weight")
    r: int = Field(8, gt=0, description="adapter rank")
    alpha: float = Field(16.0, gt=0, description="scale: the adapter's update is multiplied by alpha / r")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    target_modules: list[str] | Literal["all-linear"] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="module names that get adapters, or all-linear (every linear layer but the output head)",
    )


class ModelSource(Section):
    """Where a model comes from: a local transformers directory, or a GGUF file inside it."""

    path: str = Field(
        description="a transformers model directory, a .gguf file, or a hub id already in the local HF cache"
    )
    gguf_file: str | None = Field(None, description="file name of a GGUF checkpoint inside `path`")
    dtype: Dtype | None = Field(
        None,
        description="weights' dtype; unset = by run.precision: bfloat16 for frozen weights (reference, reward "
        "model, LoRA bases) under bf16, float32 for every trained weight and under fp32",
    )
    quantize: Literal["int8", "nf4"] | None = Field(
        None,
        description="frozen weights only (reference, reward model, a LoRA policy's base: QLoRA): the decoder's "
        "linear layers in 8 bits (int8, weight-only) or 4-bit NormalFloat (nf4) with torchao; embeddings and "
        "heads stay in `dtype`. docs/memory.md measures the log-prob and score error",
    )
    offload: Literal["none", "model", "layers"] = Field(
        "none",
        description="frozen models on CUDA only: weights in pinned host memory, brought to the GPU whole for "
        "each pass (model) or one layer at a time (layers)",
    )
    trust_remote_code: bool = Field(
        False, description="run the model's own modelling code from its directory"
    )
    chat_template: str | None = Field(None, description="Jinja template overriding the tokenizer's own")


class ValueConfig(Section):
    """The critic: a separate network, or a scalar head on the policy's backbone (``shared``)."""

    mode: Literal["separate", "shared"] = Field(
        "separate",
        description="separate = its own network (init_from), shared = a scalar head on the policy's trunk",
    )
    init_from: Literal["reward", "policy"] = Field("reward", description="backbone of a separate critic")
    path: str | None = Field(
        None,
        description="a critic an earlier run saved (its final/value/ or best/value/) to start from, of the "
        "same mode; null = the policy directory's value/ when it holds one of this mode, else a new critic",
    )
    lora: LoraConfig = LoraConfig()


class ModelsConfig(Section):
    """The four models: the trained policy, its frozen reference and the critic (the reward is its own section)."""

    policy: ModelSource = Field(description="the model PPO trains, usually an SFT checkpoint")
    policy_lora: LoraConfig = LoraConfig()
    reference: ModelSource | None = Field(
        None, description="defaults to the policy's starting weights (the adapter disabled with LoRA)"
    )
    value: ValueConfig = ValueConfig()
