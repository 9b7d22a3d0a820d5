"""Frozen weights in 8 or 4 bits, and frozen models kept in host memory: the seeds' memory ladder after
LoRA ("quantise the frozen pair", "offload it").

``quantize: int8 | nf4`` on a frozen model section (the reference, a reward model, a LoRA policy's base:
QLoRA) stores the weights of the decoder's linear layers with torchao, which runs the same code on CPU and
CUDA: ``int8`` weight-only (one scale per output row), ``nf4`` QLoRA's 4-bit NormalFloat (blocks of 64
weights, their scales quantized again). Embeddings, norms, the LM head and a score head stay in the
section's ``dtype``: they are a small share of a large model, the LM head decides every log-prob, and a
tied head *is* the embedding table. A matmul dequantizes its weight into the input's dtype on the fly, so
quantization saves memory, not time; docs/memory.md measures what it does to log-probs and RM scores.

``offload: model | layers`` (CUDA only) keeps a frozen model's weights in pinned host memory: ``model``
brings the whole model to the GPU for its pass and frees it after, ``layers`` streams one layer at a time
(accelerate's hooks) for a model that does not fit whole next to the trained ones.
"""

from __future__ import annotations

import contextlib
import types
import warnings
from collections.abc import Iterator

import torch
from torch import nn

from lmppo.inputs.resolve import require_torchao

NF4_BLOCK = 64  # weights per scale, as QLoRA
# Bytes per quantized weight: int8 is one byte (its per-row fp32 scale is below 0.1 % of a row of a few
# thousand); nf4 is half a byte + one int8 scale per block of 64 + an fp32 factor per block of 64 scales.
QUANTIZED_BYTES = {"int8": 1.0, "nf4": 0.5 + 1 / NF4_BLOCK + 4 / NF4_BLOCK**2}


def quantizable_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The linear layers :func:`quantize` stores in 8/4 bits: every ``nn.Linear`` except the LM head (the
    output embeddings, tied to the input ones in many models) and a sequence classifier's ``score`` head.
    Layers already wrapped by LoRA are reached through their ``base_layer``."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    keep = {id(output), id(getattr(model, "score", None))}
    return [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear and id(module) not in keep and name.split(".")[-1] != "score"
    ]


def quantize(model: nn.Module, scheme: str) -> nn.Module:
    """Store ``model``'s :func:`quantizable_linears` weights in ``scheme`` (``int8`` or ``nf4``), in place
    (frozen: no gradient reaches them). Returns ``model``."""
    require_torchao(f"quantize={scheme}")
    with warnings.catch_warnings():  # torchao names its optional CUDA kernels it could not load on import
        warnings.simplefilter("ignore")
        from torchao.quantization import Int8WeightOnlyConfig, quantize_, to_nf4
    for _, linear in quantizable_linears(model):
        if scheme == "int8":
            quantize_(linear, Int8WeightOnlyConfig())
            linear.forward = types.MethodType(_int8_forward, linear)
        else:  # NF4Tensor's own linear keeps the 4-bit weight for the backward already
            linear.weight = nn.Parameter(_nf4(to_nf4, linear.weight.detach()), requires_grad=False)
        linear.weight.requires_grad_(False)
    # The weights left as they are may still live in the memory-mapped weight file, every page of which
    # quantizing has read: copied out, the mapping (the whole 16/32-bit file) is released.
    for param in model.parameters():
        if not is_quantized(param):
            param.data = param.data.clone()
    return model


class _FrozenInt8Linear(torch.autograd.Function):
    """``x W^T`` for a frozen int8 ``W`` that keeps ``W`` as stored for the backward. Through torchao's
    linear, autograd would keep the fp32 copy it dequantized and multiplied: 4 bytes per weight of every
    layer until the backward, more than the fp32 model itself (LoRA's update of a QLoRA policy)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return nn.functional.linear(x, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (weight,) = ctx.saved_tensors
        return grad @ weight.dequantize(grad.dtype), None


def _int8_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    y = _FrozenInt8Linear.apply(x, self.weight)
    return y if self.bias is None else y + self.bias


def _nf4(to_nf4, weight: torch.Tensor):
    """``weight`` in NF4; the scales are quantized in the largest block (of up to 256) that divides their
    number (SmolLM2's 576 x 576: 5184 scales, blocks of 64)."""
    scales = weight.numel() // NF4_BLOCK
    block = next(b for b in (256, 128, 64, 32, 16, 8, 4, 2, 1) if scales % b == 0)
    return to_nf4(weight, NF4_BLOCK, block)


def is_quantized(weight: torch.Tensor) -> bool:
    """A weight :func:`quantize` stored (a torchao tensor subclass), which cannot be folded or trained."""
    return type(weight).__module__.startswith("torchao")


def quantization_of(model: nn.Module) -> str | None:
    """The scheme of ``model``'s quantized weights (``int8``, ``nf4``), None when it has none."""
    for param in model.parameters():
        if is_quantized(param):
            return "nf4" if "NF4" in type(param).__name__ else "int8"
    return None


def quantized_weight_bytes(model: nn.Module) -> int:
    """Bytes of the quantized weights as stored: their inner tensors (data, scales)."""
    return sum(_tensor_bytes(param) for param in model.parameters() if is_quantized(param))


def _tensor_bytes(tensor: torch.Tensor) -> int:
    if is_quantized(tensor):
        inner, _ = tensor.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(tensor, name)) for name in inner)
    return tensor.numel() * tensor.element_size()


# --------------------------------------------------------------------------------------------------
# Offloading frozen models (CUDA)
# --------------------------------------------------------------------------------------------------


def offload(model: nn.Module, how: str, device: torch.device) -> nn.Module:
    """Keep frozen ``model``'s weights in host memory: ``model`` pins them (run its passes inside
    :func:`on_device`); ``layers`` hands it to accelerate's hooks, which move each layer's weights to
    ``device`` for its forward and drop them after."""
    if how == "layers":
        from accelerate import cpu_offload

        return cpu_offload(model.cpu(), execution_device=device)
    for module in model.modules():  # buffers (rotary tables) are small: they stay on the device
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)
    for param in model.parameters():
        param.data = param.data.cpu().pin_memory()
    model._lmppo_offloaded = device  # what on_device moves it to
    return model


@contextlib.contextmanager
def on_device(model: nn.Module) -> Iterator[nn.Module]:
    """A model offloaded whole, on its device for the block: the pinned host weights are copied over
    (asynchronously) and the device copies are freed at the end. Any other model passes through."""
    device = getattr(model, "_lmppo_offloaded", None)
    if device is None:
        yield model
        return
    pinned = [(param, param.data) for param in model.parameters()]
    try:
        for param, host in pinned:
            param.data = host.to(device, non_blocking=True, copy=True)
        yield model
    finally:
        for param, host in pinned:
            param.data = host
