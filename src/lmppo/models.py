"""The four models of PPO-RLHF: loading, freezing, LoRA, the value model and identity records.

- Policy and reference are causal LMs; the reward model is a sequence scorer
  (``AutoModelForSequenceClassification``, one label); the value model is a backbone with a scalar head.
- Everything loads from local files only: a transformers directory (safetensors), a GGUF file, or a hub id
  that is already in the local Hugging Face cache. Nothing is ever downloaded.
- With LoRA the reference is the policy with its adapter disabled (:class:`LoraReference`): no second copy
  of the weights.
- Frozen models are in ``eval()`` with no grads; trained models are put in ``eval()`` by :func:`eval_mode`
  for the passes whose results are stored (dropout there makes ``logp_old`` irreproducible).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import ctypes.util
import hashlib
import json
import os
import platform
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners import lora
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import ModulesToSaveWrapper
from safetensors import SafetensorError
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.modeling_layers import GradientCheckpointingLayer

from lmppo.config import ModelSource
from lmppo.errors import LmppoError
from lmppo.resolve import RoleSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


# --------------------------------------------------------------------------------------------------
# Locating model files (never downloading)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResolvedSource:
    """Where a model's files are on disk: a local directory, plus the GGUF file name inside it if any."""

    directory: Path
    gguf_file: str | None = None

    def __str__(self) -> str:
        return str(self.directory / self.gguf_file) if self.gguf_file else str(self.directory)


def as_model_source(model: ModelSource | str | os.PathLike) -> ModelSource:
    """A config model section as given, or a bare path as one with every default (fp32, no GGUF)."""
    return model if isinstance(model, ModelSource) else ModelSource(path=str(model))


def resolve_source(model: ModelSource | str | os.PathLike) -> ResolvedSource:
    """Find a model section's (or a bare path's) files: a directory, a ``.gguf`` file, or a hub id already
    in the local HF cache. Raises :class:`LmppoError` when nothing is on disk: lmppo never downloads.
    """
    spec = as_model_source(model)
    local, gguf_file = Path(spec.path).expanduser(), spec.gguf_file
    if local.is_file() and local.suffix == ".gguf" and gguf_file is None:
        return ResolvedSource(local.parent, local.name)
    if local.is_file():
        raise LmppoError(
            f"model path {spec.path!r} is a file, not a model: point it at a transformers model directory "
            "(config.json and safetensors weights) or a .gguf file"
        )
    if local.is_dir():
        if gguf_file is not None and not (local / gguf_file).is_file():
            raise LmppoError(
                f"GGUF file {gguf_file!r} not found in {local}; check `gguf_file` in the config."
            )
        return ResolvedSource(local, gguf_file)
    cached = _local_hub_snapshot(spec.path)
    if cached is None:
        raise LmppoError(
            f"model path {spec.path!r} does not exist and is not in the local Hugging Face cache. "
            "lmppo never downloads models: fetch it first (e.g. `hf download ORG/NAME --local-dir DIR`) "
            "and point the config at that directory."
        )
    return resolve_source(ModelSource(path=str(cached), gguf_file=gguf_file))


def _local_hub_snapshot(repo_id: str) -> Path | None:
    """The cached snapshot directory of ``repo_id`` if the HF cache already holds it, else None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        return None


def _from_pretrained_kwargs(spec: ModelSource, source: ResolvedSource, *, weights: bool = True) -> dict:
    """``from_pretrained`` keywords: local files only, the GGUF file, and (for weights) the dtype."""
    kwargs = {"local_files_only": True, "trust_remote_code": spec.trust_remote_code}
    if weights:
        kwargs["dtype"] = DTYPES[spec.dtype or "float32"]  # the config section has validated the name
    if source.gguf_file:
        kwargs["gguf_file"] = source.gguf_file
    return kwargs


def _load_error(what: str, source: ResolvedSource, err: Exception) -> LmppoError:
    if "trust_remote_code" in str(err):
        return LmppoError(
            f"{what} at {source} needs custom code from its repository; set `trust_remote_code: true` "
            f"in the model config only if you trust that code. (transformers: {err})"
        )
    return LmppoError(f"cannot load {what} from {source}: {err}")


def load_tokenizer(model: ModelSource | str | os.PathLike) -> PreTrainedTokenizerBase:
    """The tokenizer (with its chat template) of a model section (or a bare path): directory or GGUF."""
    spec = as_model_source(model)
    source = resolve_source(spec)
    try:
        return AutoTokenizer.from_pretrained(
            source.directory, **_from_pretrained_kwargs(spec, source, weights=False)
        )
    except (OSError, ValueError, KeyError) as err:
        if source.gguf_file:
            raise LmppoError(
                f"GGUF file {source} has no usable tokenizer ({err}); use a GGUF file that embeds its "
                "tokenizer, or convert the model to a transformers directory that has one."
            ) from err
        raise _load_error("the tokenizer", source, err) from err


def load_model_config(model: ModelSource | str | os.PathLike):
    """A model's architecture config alone (no weights read): what :mod:`lmppo.plan` sizes."""
    spec, source = as_model_source(model), resolve_source(model)
    try:
        return AutoConfig.from_pretrained(
            source.directory, **_from_pretrained_kwargs(spec, source, weights=False)
        )
    except (OSError, ValueError) as err:
        raise _load_error("the model config", source, err) from None


def _weights_source(model: ModelSource | str | os.PathLike) -> tuple[ModelSource, ResolvedSource]:
    """The section and its files, refusing a directory whose weights only pickle could load."""
    spec = as_model_source(model)
    source = resolve_source(spec)
    if not source.gguf_file:
        names = {p.name for p in source.directory.iterdir() if p.suffix in WEIGHT_SUFFIXES}
        if names and not any(name.endswith(".safetensors") for name in names):
            raise LmppoError(
                f"{source} holds only pickled weights ({', '.join(sorted(names))}): lmppo loads safetensors only, "
                "since unpickling runs code from the file. Convert it once, where you trust the file: "
                "`AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(NEW_DIR)` (safetensors by default)."
            )
    return spec, source


def load_causal_lm(model: ModelSource | str | os.PathLike) -> PreTrainedModel:
    """A causal LM (policy or reference) from a model section (or a bare path), in its ``dtype``."""
    spec, source = _weights_source(model)
    try:
        return AutoModelForCausalLM.from_pretrained(source.directory, **_from_pretrained_kwargs(spec, source))
    except (OSError, ValueError, SafetensorError) as err:
        raise _load_error("a causal LM", source, err) from err


def load_reward_model(model: ModelSource | str | os.PathLike, *, new_head: bool = False, pad_token_id=None):
    """A one-label sequence scorer from a model section (or a bare path), in its ``dtype``.

    By default it is a frozen reward model, and a checkpoint without a trained score head (e.g. a plain
    causal LM) is refused: transformers would silently give it a randomly initialised head. With
    ``new_head=True`` (reward-model training) a causal LM gets a fresh head and everything stays trainable;
    ``pad_token_id`` goes into its config.
    """
    spec, source = _weights_source(model)
    _check_one_label(source)
    extra = {} if pad_token_id is None else {"pad_token_id": pad_token_id}
    try:
        scorer, info = AutoModelForSequenceClassification.from_pretrained(
            source.directory,
            num_labels=1,
            output_loading_info=True,
            **extra,
            **_from_pretrained_kwargs(spec, source),
        )
    except (OSError, ValueError, RuntimeError, SafetensorError) as err:
        raise _load_error("a reward model", source, err) from err
    if new_head:
        return scorer
    untrained_head = [key for key in info["missing_keys"] if key.split(".")[0] == "score"]
    if untrained_head:
        raise LmppoError(
            f"{source} has no trained score head ({', '.join(untrained_head)} missing): it is not a reward "
            "model. Train one with `lmppo train-rm`, or point `reward.model.path` at a reward-model checkpoint."
        )
    return freeze(scorer)


def _check_one_label(source: ResolvedSource) -> None:
    """A sequence classifier with several outputs is not a reward model (transformers would resize its head)."""
    config_file = source.directory / "config.json"
    if source.gguf_file or not config_file.is_file():
        return
    config = json.loads(config_file.read_text())
    classifier = any(a.endswith("ForSequenceClassification") for a in config.get("architectures") or [])
    labels = len(config["id2label"]) if "id2label" in config else 2  # transformers omits its default, 2
    if classifier and labels != 1:
        raise LmppoError(
            f"{source} is a sequence classifier with {labels} outputs; a reward model needs one scalar "
            "(num_labels=1). Train one with `lmppo train-rm`, or use a reward model with a single output."
        )


def cache_gguf_as_transformers(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Convert a GGUF model once into a plain transformers directory (fp32 safetensors + tokenizer).

    Loading a GGUF file dequantises every tensor and converts the tokenizer (tens of seconds); the
    directory loads in about a second. ``save_pretrained`` refuses GGUF-loaded models, so the weights are
    moved into a fresh model built from the config without its ``quantization_config``. The directory
    records the GGUF file's sha256 and is rebuilt when the file changes. Returns ``out_dir``.
    """
    source = resolve_source(gguf_path)
    if source.gguf_file is None:
        raise LmppoError(f"{gguf_path} is not a .gguf file.")
    out_dir = Path(out_dir)
    gguf_sha256 = _file_sha256(source.directory / source.gguf_file)
    marker = out_dir / "lmppo_gguf_source.json"
    if marker.is_file() and json.loads(marker.read_text()).get("gguf_sha256") == gguf_sha256:
        return out_dir
    spec = ModelSource(path=str(source.directory), gguf_file=source.gguf_file)
    tokenizer = load_tokenizer(spec)
    gguf_model = load_causal_lm(spec)
    config = gguf_model.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    staging = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / marker.name).write_text(json.dumps({"gguf_file": str(source), "gguf_sha256": gguf_sha256}))
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(staging, out_dir)  # readers see either no directory or a complete one
    return out_dir


# --------------------------------------------------------------------------------------------------
# Modes: frozen, eval for stored passes
# --------------------------------------------------------------------------------------------------


def freeze(model: nn.Module) -> nn.Module:
    """Make ``model`` frozen: ``eval()`` (no dropout) and no parameter gradients. Returns it."""
    model.requires_grad_(False)
    return model.eval()


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


def unwrap_model(model):
    """The underlying transformers model of a peft model or :class:`LoraReference`; else ``model``."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """transformers' per-layer activation checkpointing on ``model`` (a causal LM, a peft model or a
    :class:`ValueModel`'s backbone). Non-reentrant, so LoRA needs no input gradients."""
    base = unwrap_model(model.backbone if isinstance(model, ValueModel) else model)
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


@dataclass
class PPOModels:
    """The four models of a run (the reward is learned RMs and programs combined, or one function)."""

    policy: nn.Module
    reference: nn.Module
    value: nn.Module
    tokenizer: object
    reward: Callable  # a lmppo.scoring.CombinedReward when built from the config
    identities: dict[str, dict] = field(default_factory=dict)

    @property
    def reward_models(self) -> list[nn.Module]:
        """The frozen networks behind the reward (none for programmatic rewards)."""
        return getattr(self.reward, "models", [])


# --------------------------------------------------------------------------------------------------
# Value model
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

        A LoRA reward model (see :func:`apply_lora`) is viewed through its adapters and trained head copy.
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
        backbone = _without_adapters(copy.deepcopy(unwrap_model(causal_lm).get_decoder()))
        backbone.requires_grad_(True)
        return cls(backbone, _zero_head(backbone, causal_lm.config.hidden_size))

    @classmethod
    def shared_trunk(cls, policy: nn.Module) -> ValueModel:
        """A zero-initialised value head on the policy's backbone (shared trunk; LoRA layers included).

        Train it with ``trainable_parameters(policy, value_model)`` and get logits and values from one
        backbone pass with :func:`lmppo.rollout.policy_logits_and_values`.
        """
        backbone = policy.get_decoder()
        return cls(backbone, _zero_head(backbone, policy.config.hidden_size), shared_trunk=True)


def make_value_model(role: RoleSpec, policy: nn.Module, reward_model: nn.Module | None) -> ValueModel:
    """The critic ``role`` describes (:func:`lmppo.resolve.value_role`): a head on ``policy``'s trunk, or a
    copy of the policy's or ``reward_model``'s network with its LoRA adapters. What is trained is fp32
    master weights, also when copied from a 16-bit frozen model."""
    if role.shares:
        return ValueModel.shared_trunk(policy)
    if role.init_from == "reward":
        value = ValueModel.from_reward_model(reward_model)
    else:
        value = ValueModel.from_causal_lm(policy)
    (value.head if role.lora is not None else value).float()
    return with_lora(value, role.lora)


def _without_adapters(module: nn.Module) -> nn.Module:
    """Replace every peft-injected layer in ``module`` by the base layer it wraps (in place)."""
    for name, child in module.named_children():
        if isinstance(child, BaseTunerLayer):
            setattr(module, name, child.get_base_layer())
        else:
            _without_adapters(child)
    return module


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


# --------------------------------------------------------------------------------------------------
# LoRA and the reference
# --------------------------------------------------------------------------------------------------


def apply_lora(
    model: nn.Module,
    *,
    r: int,
    alpha: float,
    dropout: float = 0.0,
    target_modules: str | list[str] = "all-linear",
) -> nn.Module:
    """Wrap a causal LM or a sequence classifier (returns a ``PeftModel``), or a separate
    :class:`ValueModel`'s backbone, with LoRA.

    Only the adapter stays trainable, plus a value model's head, or a sequence classifier's ``score`` head
    in full (peft's ``SEQ_CLS`` task keeps a trained copy of it, ``modules_to_save``: a new head is not
    low-rank). ``target_modules="all-linear"`` targets every linear layer except the output/score layer.
    ``merge_and_unload()`` turns the result back into a plain transformers model with the trained weights.
    """
    config = {"r": r, "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": target_modules}
    if isinstance(model, ValueModel):
        if model.shared_trunk:
            raise LmppoError("a shared-trunk value model gets LoRA through the policy; apply LoRA there.")
        model.backbone = get_peft_model(model.backbone, LoraConfig(task_type="FEATURE_EXTRACTION", **config))
        return model
    task_type = "SEQ_CLS" if type(model).__name__.endswith("ForSequenceClassification") else "CAUSAL_LM"
    return get_peft_model(model, LoraConfig(task_type=task_type, **config))


def with_lora(model: nn.Module, lora) -> nn.Module:
    """``model`` with LoRA adapters as configured (a :class:`lmppo.config.LoraConfig`) when given and
    enabled, else ``model`` itself (all weights trained)."""
    if lora is None or not lora.enabled:
        return model
    return apply_lora(
        model, r=lora.r, alpha=lora.alpha, dropout=lora.dropout, target_modules=lora.target_modules
    )


class LoraReference:
    """The frozen reference of a LoRA policy: the same base weights, run with the adapter disabled.

    Deliberately not an ``nn.Module``: the policy is not registered a second time (no duplicate
    parameters in ``parameters()``, ``state_dict()`` or DDP). Train/eval flags are the policy's.
    """

    def __init__(self, policy: PeftModel) -> None:
        if not isinstance(policy, PeftModel):
            raise TypeError("LoraReference needs a peft-wrapped policy; see apply_lora")
        self.policy = policy

    def __call__(self, **kwargs):
        with self.policy.disable_adapter():
            return self.policy(**kwargs)

    @property
    def training(self) -> bool:
        return self.policy.training

    def modules(self):
        """The policy's modules: what a pass of the reference runs (and FSDP2 gathers for it)."""
        return self.policy.modules()

    def train(self, mode: bool = True) -> LoraReference:
        self.policy.train(mode)
        return self

    def eval(self) -> LoraReference:
        return self.train(False)

    @property
    def config(self):
        return self.policy.config

    def get_base_model(self) -> PreTrainedModel:
        return self.policy.get_base_model()


def make_reference(policy: nn.Module) -> nn.Module | LoraReference:
    """The reference for ``policy`` (call before training): adapter-disabled view with LoRA, else a frozen copy."""
    if isinstance(policy, PeftModel):
        return LoraReference(policy)
    return freeze(copy.deepcopy(policy))


def mergeable_lora_layers(model: nn.Module) -> list[lora.Linear]:
    """The LoRA linears of ``model`` that :func:`lora_merged` can fold, or ``[]`` when it must not fold any.

    Folding needs fp32 base weights and no autocast: ``W + s B A`` rounded to 16 bits loses an update
    that is small against ``W`` (all of it at the start of training), so a 16-bit merged copy would sample
    from another policy than the one the update differentiates. FSDP2 owns its modules' parameters, and
    DoRA's merged weight is not ``W + s B A``: neither is folded.
    """
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    device_type = next(model.parameters()).device.type
    if (
        not layers
        or torch.is_autocast_enabled(device_type)
        or any(isinstance(m, FSDPModule) for m in model.modules())
    ):
        return []
    for layer in layers:
        if (
            not isinstance(layer, lora.Linear)
            or layer.merged
            or layer.disable_adapters
            or layer.get_base_layer().weight.dtype != torch.float32
            or any(layer.use_dora.get(name) for name in layer.active_adapters)
        ):
            return []
    return layers


@contextlib.contextmanager
def lora_merged(model: nn.Module) -> Iterator[None]:
    """Run ``model`` with every LoRA adapter folded into a temporary copy of its base weight (no grad).

    At decode's few rows per step a LoRA linear is three small matmuls whose cost is dispatch, not
    FLOPs: folded, each is one (SmolLM2-135M, batch 16: ~15 % of a decode step). The base weights are
    never written: peft's ``merge_adapter`` adds and later subtracts ``s B A`` in place, and that
    rounding would drift the frozen weights the reference (adapter disabled) runs on. The copy costs the
    adapted weights once more while it lives. Outputs equal the unfolded ones up to float rounding.
    A model :func:`mergeable_lora_layers` turns down runs as it is.
    """
    if torch.is_grad_enabled():
        raise RuntimeError(
            "lora_merged is for inference: the folded weights carry no gradient to the adapters"
        )
    layers = mergeable_lora_layers(model)
    adapter_grads = [(p, p.requires_grad) for layer in layers for p in layer.parameters()]
    originals = []
    try:
        for layer in layers:
            base = layer.get_base_layer()
            delta = sum(layer.get_delta_weight(name) for name in layer.active_adapters)
            originals.append((base, base.weight))
            base.weight = nn.Parameter(base.weight + delta, requires_grad=False)
            layer.enable_adapters(False)
        yield
    finally:
        for base, weight in originals:
            base.weight = weight
        for layer in layers:
            layer.enable_adapters(True)
        for param, requires_grad in adapter_grads:  # enable_adapters sets the flags its own way
            param.requires_grad_(requires_grad)


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


def weight_files(source: ResolvedSource) -> list[Path]:
    """A model's weight files: its GGUF file, or the directory's weight files sorted by name."""
    if source.gguf_file:
        return [source.directory / source.gguf_file]
    return sorted(p for p in source.directory.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())


def weights_sha256(source: ResolvedSource) -> str:
    """sha256 over a model's weight files (name and content hash of each, sorted by name)."""
    files = weight_files(source)
    if not files:
        raise LmppoError(f"no weight files ({', '.join(WEIGHT_SUFFIXES)}) in {source}.")
    return _text_sha256("".join(f"{p.name}:{_file_sha256(p)}\n" for p in files))


def tokenizer_sha256(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 of the tokenizer's full definition (vocab, merges, normalisation, special tokens)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = (
        backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    )
    return _text_sha256(definition + json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str))


def _text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()
