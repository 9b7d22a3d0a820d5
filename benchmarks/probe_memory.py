"""What each phase of a step allocates, and what the update's autograd keeps, measured inside one ``lmppo ppo``
run on CPU: the numbers ``runs/plan.py``'s constants are fitted to (docs/memory.md).

    .venv/bin/python benchmarks/probe_memory.py examples/smollm2/ppo_judge.yaml run.output_dir=/tmp/probe \\
        run.steps=1 ppo.ppo_epochs=1 run.eval_every=0                 # any `lmppo ppo` arguments

- Per phase (rollout, stored passes, update, evaluation): the largest rise of the bytes glibc's heap has in
  use (``mallinfo2``: ``uordblks + hblkhd``) above the phase's start, polled every millisecond by a thread.
  That is what the plan's phase rows estimate; the resident peak adds the heap's retention on top.
- For the first micro-batch of the update: the bytes of the tensors autograd saves for the backward, inside
  decoder layers (in all, per token and layer, and by dtype and last dimension) and outside them (the
  logits), counted once per storage and leaving out parameters.

Prints one JSON line ``probe {...}`` at exit. Linux (glibc) only; the polling slows the run down.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import sys
import threading
import time
from collections import Counter

import torch

from lmppo.interface.cli import main
from lmppo.runs import evaluate
from lmppo.training import sampler, scorer, trainer


class MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


LIBC = ctypes.CDLL("libc.so.6")
LIBC.mallinfo2.restype = MallInfo2
MIB = 2**20
PHASES: dict[str, int] = {}  # phase -> largest rise in MiB
SAVED: dict = {}
ACTIVE: list[list[int]] = []  # [start, peak] of each phase running now


def in_use() -> int:
    info = LIBC.mallinfo2()
    return info.uordblks + info.hblkhd


def poll() -> None:
    while True:
        now = in_use()
        for entry in ACTIVE:
            entry[1] = max(entry[1], now)
        time.sleep(0.001)


def measured(owner, name: str, phase: str) -> None:
    """Wrap ``owner.name`` so that each call's rise above its start counts for ``phase``."""
    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        entry = [in_use(), 0]
        ACTIVE.append(entry)
        try:
            return original(*args, **kwargs)
        finally:
            ACTIVE.remove(entry)
            rise = (max(entry[1], in_use()) - entry[0]) // MIB
            PHASES[phase] = max(PHASES.get(phase, 0), rise)

    setattr(owner, name, wrapped)


def storage(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(address, bytes) of a tensor's storage; None for a tensor subclass (a quantized weight)."""
    try:
        untyped = tensor.untyped_storage()
        return untyped.data_ptr(), untyped.nbytes()
    except (RuntimeError, NotImplementedError):
        return None


def count_saved(original):
    """``micro_batch_loss`` that counts, on its first call, what autograd saves inside and outside layers."""
    where = ["outside"]

    def counted(self, micro, *args, **kwargs):
        if SAVED:
            return original(self, micro, *args, **kwargs)
        layers = [m for m in self.train_module.modules() if type(m).__name__.endswith("DecoderLayer")]
        hooks = [m.register_forward_pre_hook(lambda *_: where.__setitem__(0, "layer")) for m in layers]
        hooks += [m.register_forward_hook(lambda *_: where.__setitem__(0, "outside")) for m in layers]
        weights = {storage(p) for p in [*self.train_module.parameters(), *self.train_module.buffers()]}
        seen: dict[int, tuple[str, int, str, int]] = {}  # address -> (where, bytes, dtype, last dim)

        def pack(tensor):
            found = storage(tensor)
            if found and found not in weights and found[0] not in seen:
                seen[found[0]] = (
                    where[0],
                    found[1],
                    str(tensor.dtype),
                    tensor.shape[-1] if tensor.dim() else 0,
                )
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            result = original(self, micro, *args, **kwargs)
        for hook in hooks:
            hook.remove()
        tokens = len(micro) * (micro.query_ids.shape[1] + micro.response_ids.shape[1])
        inside = sum(b for w, b, *_ in seen.values() if w == "layer")
        by_width = Counter()
        for w, b, dtype, width in seen.values():
            if w == "layer":
                by_width[f"{dtype} x {width}"] += b
        SAVED.update(
            tokens=tokens,
            layers=len(layers),
            inside_mib=round(inside / MIB, 1),
            outside_mib=round(sum(b for w, b, *_ in seen.values() if w == "outside") / MIB, 1),
            per_token_layer_bytes=round(inside / (tokens * len(layers))) if layers else None,
            by_width_mib={k: round(v / MIB, 1) for k, v in by_width.most_common()},
        )
        return result

    return counted


def report() -> None:
    print("probe " + json.dumps({"phases_mib": PHASES, "update_saved": SAVED}), file=sys.stderr, flush=True)


if __name__ == "__main__":
    measured(sampler.Sampler, "generate", "rollout")
    measured(scorer.Scorer, "stored_pass", "stored passes")
    measured(trainer.PPOTrainer, "accumulate", "update")
    measured(evaluate, "evaluate_policy", "evaluation")
    trainer.PPOTrainer.micro_batch_loss = count_saved(trainer.PPOTrainer.micro_batch_loss)
    threading.Thread(target=poll, daemon=True).start()
    atexit.register(report)
    sys.argv = ["lmppo", "ppo", *sys.argv[1:]]
    main()
