"""``run.compile``: every decoder layer's forward compiled by ``torch.compile`` for the passes over whole
sequences (the update's forward and backward, the stored passes), where a step spends its element-wise
time (norms, rotary embeddings, the gated MLP's activation, residual adds) in thousands of small kernels
that inductor fuses. The decode loop stays eager: its one-token forwards write a KV cache in place.

One compiled function per layer type, shared by every layer (torch inlines the modules, so their weights
are inputs, not constants), and shapes symbolic (``dynamic=True``): any rows and sequence length reuse
the graph, so a run compiles one graph per grad mode (the update; the stored passes without gradients)
and precision, not one per micro-batch shape. LoRA adapters trace into it; FSDP2's per-layer hooks stay
outside it (they run around ``forward``). Compiled code is cached on disk by inductor, in
:func:`cache_dir` (clear it by deleting it), so a resume or the next run of the same models starts warm.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from lmppo.modeling.models import decoder_layers

_WHOLE_SEQUENCES = contextvars.ContextVar("whole_sequences", default=False)


def cache_dir() -> Path:
    """Where inductor keeps compiled code: ``TORCHINDUCTOR_CACHE_DIR`` when set, else set to
    ``~/.cache/lmppo/inductor`` (``$XDG_CACHE_HOME`` honoured) for this process and the ranks it starts."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lmppo" / "inductor"
    return Path(os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(default)))


def compile_layers(*models: nn.Module | None) -> int:
    """Compile the decoder layers of ``models`` (each layer once, however many models hold it) for
    :func:`whole_sequences`; returns how many layers. Call it after anything copies the models (a
    snapshot engine's deepcopy would share the compiled forwards)."""
    cache_dir()
    layers = {id(layer): layer for model in models if model is not None for layer in decoder_layers(model)}
    for layer in layers.values():
        eager = layer.forward
        compiled = torch.compile(eager, dynamic=True)
        layer.forward = functools.partial(_either, eager, compiled)
    return len(layers)


def _either(eager, compiled, *args, **kwargs):
    return (compiled if _WHOLE_SEQUENCES.get() else eager)(*args, **kwargs)


@contextlib.contextmanager
def whole_sequences() -> Iterator[None]:
    """A pass over whole sequences, which compiled layers run compiled (eager everywhere else)."""
    token = _WHOLE_SEQUENCES.set(True)
    try:
        yield
    finally:
        _WHOLE_SEQUENCES.reset(token)


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far (``perf/compiles``)."""
    from torch._dynamo.utils import counters  # noqa: PLC0415  (private: no public counter exists)

    return int(counters["stats"]["unique_graphs"])
