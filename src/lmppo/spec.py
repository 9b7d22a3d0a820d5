"""The decisions a config implies, made once and read by everything else: the device, the precision of
the forward passes, each model's weight dtype, and the checks that need several sections at once (run
before any model is loaded). `lmppo plan`, the builders, the pre-flight and `lmppo eval` all ask here.
"""

from __future__ import annotations

import torch

from lmppo.config import Config, ModelSource
from lmppo.errors import LmppoError


def resolve_device(name: str, *, present: bool = True) -> torch.device:
    """``run.device``: auto picks CUDA when a device is visible. ``present=False`` for a plan, which may be
    made for a CUDA device this machine does not have."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and present and not torch.cuda.is_available():
        raise LmppoError("run.device=cuda but no CUDA device is visible; use run.device=cpu or auto")
    return torch.device(name)


def resolve_precision(precision: str, device: torch.device) -> str:
    """``run.precision`` for this device: ``auto`` is bf16 on a CUDA device with bf16 support (assumed for
    one that is planned for but not present), else fp32 (CPUs without AMX run bf16 matmuls no faster)."""
    if precision != "auto":
        return precision
    if device.type != "cuda":
        return "fp32"
    return "bf16" if not torch.cuda.is_available() or torch.cuda.is_bf16_supported() else "fp32"


def settled_dtype(section: ModelSource, where: str, *, precision: str, trained: bool) -> ModelSource:
    """``section`` with its weights' dtype decided: unset means bfloat16 for frozen weights under bf16
    and float32 otherwise. Trained weights are fp32 masters (bf16 Adam updates round away small steps),
    so an explicit 16-bit dtype on fully trained weights is refused."""
    if section.dtype is None:
        dtype = "bfloat16" if precision == "bf16" and not trained else "float32"
        return section.model_copy(update={"dtype": dtype})
    if trained and section.dtype != "float32":
        raise LmppoError(
            f"{where}.dtype={section.dtype} would train every weight in 16 bits, with no fp32 master copy "
            f"for Adam's small updates; remove {where}.dtype (run.precision=bf16 computes in bf16 and keeps "
            "fp32 weights), or train LoRA adapters on the 16-bit base (models.policy_lora.enabled=true)"
        )
    return section


def policy_spec(cfg: Config, precision: str) -> ModelSource:
    """``models.policy`` with its dtype settled: fp32 when all of it is trained, by precision under LoRA."""
    return settled_dtype(
        cfg.models.policy, "models.policy", precision=precision, trained=not cfg.models.policy_lora.enabled
    )


def check_value_source(cfg: Config) -> None:
    """A critic initialised from the reward model needs one: refused before anything is loaded."""
    v = cfg.models.value
    learned = any(source.model is not None for source in cfg.reward.sources())
    if v.mode != "shared" and v.init_from == "reward" and not learned:
        raise LmppoError(
            "models.value.init_from=reward needs a reward model (reward.model, or a learned reward component); "
            "with a programmatic reward use models.value.init_from=policy"
        )
