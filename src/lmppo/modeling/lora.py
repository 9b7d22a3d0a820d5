"""LoRA adapters (peft) on a trained model, the reference of a LoRA policy (the same base weights run with
the adapter disabled: no second copy) and the decode loop's folded adapters.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners import lora
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers import PreTrainedModel

from lmppo.modeling.loading import freeze, renames_unannounced
from lmppo.modeling.quantize import is_quantized


def apply_lora(
    model: nn.Module,
    *,
    r: int,
    alpha: float,
    dropout: float = 0.0,
    target_modules: str | list[str] = "all-linear",
    task_type: str | None = None,
) -> PeftModel:
    """Wrap a causal LM or a sequence classifier with LoRA (``task_type`` ``FEATURE_EXTRACTION``: a bare
    backbone, as a separate critic's, :meth:`lmppo.modeling.models.ValueModel.with_lora`).

    Only the adapter stays trainable, or for a sequence classifier also its ``score`` head in full (peft's
    ``SEQ_CLS`` task keeps a trained copy of it, ``modules_to_save``: a new head is not low-rank).
    ``target_modules="all-linear"`` targets every linear layer except the output/score layer.
    ``merge_and_unload()`` turns the result back into a plain transformers model with the trained weights.
    """
    config = {"r": r, "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": target_modules}
    if task_type is None:
        task_type = "SEQ_CLS" if type(model).__name__.endswith("ForSequenceClassification") else "CAUSAL_LM"
    with renames_unannounced(), warnings.catch_warnings():
        # on an int8 base peft warns that it cannot merge into it: lmppo never does
        # (lmppo.runs.run.dequantized)
        warnings.filterwarnings("ignore", "TorchaoLoraLinear was instantiated", UserWarning)
        return get_peft_model(model, LoraConfig(task_type=task_type, **config))


def with_lora(model: nn.Module, lora, task_type: str | None = None) -> nn.Module:
    """``model`` with LoRA adapters as configured (a :class:`lmppo.inputs.config.LoraConfig`) when given and
    enabled, else ``model`` itself (all weights trained)."""
    if lora is None or not lora.enabled:
        return model
    return apply_lora(
        model,
        r=lora.r,
        alpha=lora.alpha,
        dropout=lora.dropout,
        target_modules=lora.target_modules,
        task_type=task_type,
    )


def inputs_left_to_autocast(*models: nn.Module) -> None:
    """Stop peft casting each LoRA branch's input to the adapter's dtype, for models that only run under
    bf16 autocast: autocast casts that fp32 copy straight back to bf16 for the matmul, so the result is
    the same without it, and it was two copies of every adapted linear's input per forward (SmolLM2 LoRA:
    ~84 000 small casts in a PPO step). Run without autocast, such a model fails loudly on the dtypes."""
    for model in models:
        for module in model.modules():
            if isinstance(module, BaseTunerLayer):
                module.cast_input_dtype_enabled = False


def unwrap_model(model):
    """The underlying transformers model of a peft model or :class:`LoraReference`; else ``model``."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def without_adapters(module: nn.Module) -> nn.Module:
    """Replace every peft-injected layer in ``module`` by the base layer it wraps (in place)."""
    for name, child in module.named_children():
        if isinstance(child, BaseTunerLayer):
            setattr(module, name, child.get_base_layer())
        else:
            without_adapters(child)
    return module


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


# --------------------------------------------------------------------------------------------------
# The decode loop's folded adapters
# --------------------------------------------------------------------------------------------------


def mergeable_lora_layers(model: nn.Module) -> list[lora.Linear]:
    """The LoRA linears of ``model`` that :func:`lora_merged` can fold, or ``[]`` when it must not fold any.

    The base is fp32 outside autocast, or bf16 under bf16 autocast. An fp32 base under autocast is not
    folded: the folded copy would be cast to bf16 again at every op. A bf16 fold rounds ``W + s B A``
    to bf16, which drops the part of the update below half a bf16 step of ``W``; the unfolded forward
    under autocast rounds the adapter's output into a bf16 sum the same way, and the engine/logp_gap
    metric shows what is left (docs/performance.md). FSDP2 owns its modules' parameters, and
    DoRA's merged weight is not ``W + s B A``: neither is folded, nor a quantized base (QLoRA) whose fold
    would be a dequantized copy of every adapted weight.
    """
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    device_type = next(model.parameters()).device.type
    autocast = torch.is_autocast_enabled(device_type)
    if autocast and torch.get_autocast_dtype(device_type) != torch.bfloat16:
        return []
    foldable = torch.bfloat16 if autocast else torch.float32
    if not layers or any(isinstance(m, FSDPModule) for m in model.modules()):
        return []
    for layer in layers:
        if (
            not isinstance(layer, lora.Linear)
            or layer.merged
            or layer.disable_adapters
            or layer.get_base_layer().weight.dtype != foldable
            or is_quantized(layer.get_base_layer().weight)
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
            folded = (base.weight.float() + delta).to(base.weight.dtype)  # one rounding, from fp32
            base.weight = nn.Parameter(folded, requires_grad=False)
            layer.enable_adapters(False)
        yield
    finally:
        for base, weight in originals:
            base.weight = weight
        for layer in layers:
            layer.enable_adapters(True)
        for param, requires_grad in adapter_grads:  # enable_adapters sets the flags its own way
            param.requires_grad_(requires_grad)
