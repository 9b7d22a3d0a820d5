"""The models of a run once loaded: the value model (a head on a backbone: the policy's trunk, or a
separate network), the record of the four models, their identity records, and what is done to any of them
(evaluation mode, activation checkpointing, bf16 autocast, the trainable parameters, the heap's tuning).

Loading is :mod:`lmppo.modeling.loading`; LoRA and the reference view are :mod:`lmppo.modeling.lora`. Trained
models are put in ``eval()`` by :func:`eval_mode` for the passes whose results are stored (dropout there makes
``logp_old`` irreproducible).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import ctypes.util
import hashlib
import json
import platform
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from peft import PeftModel
from peft.utils import ModulesToSaveWrapper
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel, PreTrainedModel, PreTrainedTokenizerBase
from transformers.modeling_layers import GradientCheckpointingLayer

from lmppo.errors import LmppoError
from lmppo.inputs.resolve import CRITIC_RECORD, RoleSpec
from lmppo.modeling.loading import (
    DTYPES,
    WEIGHT_SUFFIXES,
    ResolvedSource,
    file_sha256,
    renames_unannounced,
    weight_files,
)
from lmppo.modeling.lora import LoraReference, unwrap_model, with_lora, without_adapters
from lmppo.modeling.quantize import quantization_of

# --------------------------------------------------------------------------------------------------
# What is done to any model
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def eval_mode(*models) -> Iterator[None]:
    """Switch ``models`` to ``eval()`` (dropout off) and restore each one's training flag afterwards."""
    was_training = [model.training for model in models]
    try:
        for model in models:
            model.eval()
        yield
    finally:
        for model, training in zip(models, was_training):
            model.train(training)


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """transformers' per-layer activation checkpointing on ``model`` (a causal LM, a peft model or a
    :class:`ValueModel`'s backbone). Non-reentrant, so LoRA needs no input gradients."""
    base = unwrap_model(model.backbone if isinstance(model, ValueModel) else model)
    with renames_unannounced():
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def decoder_layers(module: nn.Module) -> list[nn.Module]:
    """The transformer blocks of ``module`` (the units of activation checkpointing and of FSDP2)."""
    return [m for m in module.modules() if isinstance(m, GradientCheckpointingLayer)]


def checkpointed_layers(module: nn.Module) -> list[nn.Module]:
    """The layers of ``module`` set up for activation checkpointing."""
    return [m for m in decoder_layers(module) if m.gradient_checkpointing]


@contextlib.contextmanager
def checkpointing(layers: list[nn.Module]) -> Iterator[None]:
    """Let ``layers`` checkpoint during this forward. transformers checkpoints a layer only while it is in
    training mode, and lmppo keeps every model in eval (no dropout, so the first PPO ratio is exactly 1):
    only the layers' own flags are set, their attention, MLP and dropout submodules stay in eval."""
    for layer in layers:
        layer.training = True
    try:
        yield
    finally:
        for layer in layers:
            layer.training = False


def keep_freed_heap_memory() -> bool:
    """On Linux with glibc, keep memory that torch frees for its next tensors instead of returning it.

    By default glibc serves every block over a (dynamic) threshold with a fresh ``mmap`` and unmaps it on
    free, so each large tensor of every step is page-faulted and zeroed by the kernel again: 0.87M page
    faults and 7 s of system time per SmolLM2 PPO step on the 2-core machine of docs/performance.md.
    With ``mmap`` off and the heap trimmed only past 2 GiB free, steady-state steps fault almost never
    (the update went 31 -> 27.5 s). The price: the process keeps its peak, as the CUDA caching allocator
    does on a GPU. Process-wide; returns whether it applied.
    """
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc_trim(0)  # first return what loading freed (quantizing a model frees gigabytes of scratch)
    m_trim_threshold, m_mmap_max = -1, -4  # <malloc.h>
    return bool(libc.mallopt(m_mmap_max, 0) and libc.mallopt(m_trim_threshold, 2**31 - 1))


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The forward passes' numerics: bf16 autocast (matmuls in bf16, weights and everything else as
    stored, so trained weights stay fp32 masters) or nothing for fp32."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def trainable_parameters(*models: nn.Module) -> list[nn.Parameter]:
    """Parameters with ``requires_grad`` across ``models``, each once (a shared trunk is not repeated)."""
    seen: set[int] = set()
    params = []
    for model in models:
        for param in model.parameters():
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params


# --------------------------------------------------------------------------------------------------
# The value model and the four models of a run
# --------------------------------------------------------------------------------------------------


class ValueModel(nn.Module):
    """A transformer backbone with a scalar head: ``V(s_t)`` at every position.

    ``forward(input_ids, attention_mask, position_ids) -> (B, T)`` float32: entry ``t`` is the value of the
    state whose last token is ``input_ids[:, t]`` (it is read at the position that predicts token ``t+1``).
    Build it with :meth:`from_reward_model`, :meth:`from_causal_lm` (separate networks, deep copies) or
    :meth:`shared_trunk` (a head on the policy's own backbone).
    """

    def __init__(self, backbone: nn.Module, head: nn.Linear, *, shared_trunk: bool = False) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.shared_trunk = shared_trunk  # backbone is the policy's: optimise it once, via the policy

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state  # (B, T, H)
        return self.values(hidden)

    def values(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, H) hidden states -> (B, T) float32 values; the trained head stays float32 on a
        16-bit backbone."""
        return self.head(hidden.to(next(self.head.parameters()).dtype)).squeeze(-1).float()

    @classmethod
    def from_reward_model(cls, reward_model: PreTrainedModel, *, copy_weights: bool = True) -> ValueModel:
        """Backbone and score head of a reward model: a trainable copy, or (``copy_weights=False``) a view.

        A LoRA reward model (see :func:`lmppo.modeling.lora.apply_lora`) is viewed through its adapters and
        trained head copy.
        """
        reward_model = unwrap_model(reward_model)
        backbone, head = reward_model.base_model, _score_head(reward_model)
        if copy_weights:
            backbone, head = copy.deepcopy(backbone), copy.deepcopy(head)
            backbone.requires_grad_(True)
            head.requires_grad_(True)
        return cls(backbone, head)

    @classmethod
    def from_causal_lm(cls, causal_lm: PreTrainedModel) -> ValueModel:
        """A trainable copy of a causal LM's backbone with a new zero-initialised head (``V = 0`` at start).

        With a LoRA policy the copy drops the adapter layers peft injected (it starts from the base).
        """
        backbone = without_adapters(copy.deepcopy(unwrap_model(causal_lm).get_decoder()))
        backbone.requires_grad_(True)
        return cls(backbone, _zero_head(backbone, causal_lm.config.hidden_size))

    @classmethod
    def from_saved(cls, saved: str, dtype: torch.dtype = torch.float32) -> ValueModel:
        """A separate critic an earlier run saved (:func:`save_critic`): its backbone (in ``dtype``) and head,
        trainable."""
        backbone = AutoModel.from_pretrained(saved, dtype=dtype, local_files_only=True)
        weights = load_file(Path(saved) / HEAD_FILE)
        head = nn.Linear(weights["weight"].shape[-1], 1, bias="bias" in weights)
        head.load_state_dict(weights)
        return cls(backbone.requires_grad_(True), head)

    def with_lora(self, lora) -> ValueModel:
        """LoRA adapters (a :class:`lmppo.inputs.config.LoraConfig`) on a separate critic's backbone; the head
        stays trained in full. A critic on the policy's trunk gets LoRA through the policy."""
        if self.shared_trunk:
            raise LmppoError("a shared-trunk value model gets LoRA through the policy; apply LoRA there.")
        self.backbone = with_lora(self.backbone, lora, task_type="FEATURE_EXTRACTION")
        return self

    @classmethod
    def shared_trunk(cls, policy: nn.Module) -> ValueModel:
        """A zero-initialised value head on the policy's backbone (shared trunk; LoRA layers included).

        Train it with ``trainable_parameters(policy, value_model)`` and get log-probs and values from one
        backbone pass with :func:`lmppo.sampling.passes.policy_logprobs_and_values`.
        """
        backbone = policy.get_decoder()
        return cls(backbone, _zero_head(backbone, policy.config.hidden_size), shared_trunk=True)


def make_value_model(role: RoleSpec, policy: nn.Module, reward_model: nn.Module | None) -> ValueModel:
    """The critic ``role`` describes (:func:`lmppo.inputs.resolve.value_role`): a head on ``policy``'s trunk,
    or a copy of the policy's or ``reward_model``'s network with its LoRA adapters. What is trained is fp32
    master weights, also when copied from a 16-bit frozen model."""
    if role.shares:
        value = ValueModel.shared_trunk(policy)
        if role.saved:
            _load_head(value.head, role.saved)
        return value
    if role.saved:
        value = ValueModel.from_saved(role.saved, DTYPES[role.dtype])
    elif role.init_from == "reward":
        value = ValueModel.from_reward_model(reward_model)
    else:
        value = ValueModel.from_causal_lm(policy)
    (value.head if role.lora is not None else value).float()
    return value.with_lora(role.lora)


HEAD_FILE = "value_head.safetensors"


def save_critic(
    out_dir: Path, head: dict[str, torch.Tensor], backbone: nn.Module | None, record: dict
) -> Path:
    """A trained critic as a directory a later run starts from (``models.value.path``): the head's weights,
    the record that marks it (its mode, hidden size and ``record``: step, run) and, for a separate critic,
    its backbone as a transformers model with any LoRA adapters folded in. A shared critic's trunk is the
    policy saved beside it, so it is the head alone."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if backbone is not None:
        if isinstance(backbone, PeftModel):
            backbone = backbone.merge_and_unload()
        backbone.save_pretrained(out_dir)
    save_file({k: v.detach().float().cpu().contiguous() for k, v in head.items()}, out_dir / HEAD_FILE)
    mode = "separate" if backbone is not None else "shared"
    hidden_size = head["weight"].shape[-1]
    (out_dir / CRITIC_RECORD).write_text(
        json.dumps({"mode": mode, "hidden_size": hidden_size, **record}, indent=2) + "\n"
    )
    return out_dir


def saved_critic_identity(saved: str) -> dict:
    """Where a saved critic is, its record and the hashes of its weight files (head, and backbone)."""
    files = sorted(p for p in Path(saved).iterdir() if p.suffix in WEIGHT_SUFFIXES)
    record = json.loads((Path(saved) / CRITIC_RECORD).read_text())
    return {"path": saved, **record, "sha256": {p.name: file_sha256(p) for p in files}}


def _load_head(head: nn.Linear, saved: str) -> None:
    """The saved critic's head weights into ``head``; a trunk of another width is named, not a traceback."""
    weights = load_file(Path(saved) / HEAD_FILE)
    if weights["weight"].shape != head.weight.shape or ("bias" in weights) != (head.bias is not None):
        raise LmppoError(
            f"the critic saved in {saved} has a head for hidden size {weights['weight'].shape[-1]}, and this "
            f"run's trunk has {head.in_features}: it was trained on another model. Start a new critic "
            "(leave models.value.path out) or start from that critic's policy."
        )
    with torch.no_grad():
        for name, tensor in weights.items():
            getattr(head, name).copy_(tensor)


def _score_head(reward_model: PreTrainedModel) -> nn.Module:
    """The one-output ``score`` head; under LoRA, peft's wrapper that runs the trained copy of it."""
    head = getattr(reward_model, "score", None)
    linear = head.original_module if isinstance(head, ModulesToSaveWrapper) else head
    if not isinstance(linear, nn.Linear) or linear.out_features != 1:
        raise LmppoError(
            f"{type(reward_model).__name__} has no one-output `score` head; lmppo reads rewards from "
            "`*ForSequenceClassification` models of causal LMs with num_labels=1."
        )
    return head


def _zero_head(backbone: nn.Module, hidden_size: int) -> nn.Linear:
    head = nn.Linear(hidden_size, 1, device=next(backbone.parameters()).device)  # float32: it is trained
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head


@dataclass
class PPOModels:
    """The four models of a run (the reward is learned RMs and programs combined, or one function); a
    critic-free run (``ppo.advantage`` other than gae) has no value model."""

    policy: nn.Module
    reference: nn.Module
    value: ValueModel | None
    tokenizer: object
    reward: Callable  # a lmppo.rewards.scoring.CombinedReward when built from the config
    identities: dict[str, dict] = field(default_factory=dict)

    @property
    def trained(self) -> list[nn.Module]:
        """The models the optimizer steps: the policy, and the critic when there is one."""
        return [self.policy, *([self.value] if self.value is not None else [])]

    @property
    def reward_models(self) -> list[nn.Module]:
        """The frozen networks behind the reward (none for programmatic rewards)."""
        return getattr(self.reward, "models", [])


# --------------------------------------------------------------------------------------------------
# Identity records (stored in every checkpoint manifest)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelIdentity:
    """What a model is: where it came from, hashes of its files and tokenizer, how it is set up."""

    role: str  # policy | reference | reward | value
    source: str | None  # directory or GGUF file; None for a model built in memory
    weights_sha256: str | None  # of the starting weight files (see weights_sha256)
    tokenizer_sha256: str | None
    chat_template_sha256: str | None
    dtype: str
    quantized: str | None  # int8 / nf4: the scheme of its quantized linear weights (lmppo.modeling.quantize)
    num_parameters: int
    trainable_parameters: int
    shared_with: str | None  # role whose weights this model shares (LoRA reference, shared trunk)
    lora: dict | None  # r, alpha, dropout, target_modules, adapter ("enabled" / "disabled")

    def to_dict(self) -> dict:
        return asdict(self)


def model_identity(
    role: str,
    model,
    *,
    source: ResolvedSource | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    chat_template: str | None = None,
    shared_with: str | None = None,
) -> ModelIdentity:
    """Identity record of ``model`` in ``role``. ``chat_template`` overrides the tokenizer's template."""
    view = isinstance(model, LoraReference)  # the policy's base weights, adapter excluded
    module = model.policy if view else model
    params = [p for name, p in module.named_parameters() if not (view and "lora_" in name)]  # tied once
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    return ModelIdentity(
        role=role,
        source=str(source) if source else None,
        weights_sha256=weights_sha256(source) if source else None,
        tokenizer_sha256=tokenizer_sha256(tokenizer) if tokenizer is not None else None,
        chat_template_sha256=_text_sha256(json.dumps(template, sort_keys=True)) if template else None,
        dtype=str(params[0].dtype).removeprefix("torch."),
        quantized=quantization_of(module),
        num_parameters=sum(p.numel() for p in params),
        trainable_parameters=0 if view else sum(p.numel() for p in params if p.requires_grad),
        shared_with=shared_with,
        lora=_lora_record(model),
    )


def _lora_record(model) -> dict | None:
    peft_model = model.policy if isinstance(model, LoraReference) else model
    if isinstance(peft_model, ValueModel):
        peft_model = peft_model.backbone
    if not isinstance(peft_model, PeftModel):
        return None
    config = peft_model.peft_config[peft_model.active_adapter]
    targets = config.target_modules
    return {
        "r": config.r,
        "alpha": config.lora_alpha,
        "dropout": config.lora_dropout,
        "target_modules": sorted(targets) if isinstance(targets, (set, list)) else targets,
        "adapter": "disabled" if isinstance(model, LoraReference) else "enabled",
    }


def weights_sha256(source: ResolvedSource) -> str:
    """sha256 over a model's weight files (name and content hash of each, sorted by name)."""
    files = weight_files(source)
    if not files:
        raise LmppoError(f"no weight files ({', '.join(WEIGHT_SUFFIXES)}) in {source}.")
    return _text_sha256("".join(f"{p.name}:{file_sha256(p)}\n" for p in files))


def tokenizer_sha256(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 of the tokenizer's full definition (vocab, merges, normalisation, special tokens)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = (
        backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    )
    return _text_sha256(definition + json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str))


def _text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
