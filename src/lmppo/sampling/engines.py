"""What every rollout engine shares: the :class:`Generator` protocol the trainer samples through, the
weight stream an engine with its own copy of the policy is synced from, and one-step-off rollouts.

The engines, one module each: :mod:`lmppo.sampling.hf_engine` (the transformers decode loop, on the trained
policy or a snapshot of it) and :mod:`lmppo.sampling.vllm_engine`. ``RunSpec.engine`` says which one a run
builds (:func:`lmppo.runs.build.build_generator`) and whether it owns its weights.

An engine with its own weights (vLLM, or the decode loop on a snapshot) gets the trained policy after every
update through :func:`policy_weights`: one tensor at a time, LoRA adapters folded in, and under FSDP2 one
unit (a decoder layer, then the rest) gathered at a time, so no rank holds a second whole copy beyond the
engine's own.

``rollout.asynchronous`` (:class:`RolloutsAhead`): while the trainer scores and updates on step k's batch,
a worker thread samples step k+1's with the engine's weights, which are then one version behind; the
weights are synced after the update, once that batch is done. Each rollout carries the policy version
and the log-probs it was sampled with, so the PPO ratio is taken against the sampling policy, and
``rollout.max_rollout_age`` bounds the lag. The draws of such an engine are seeded per sample
(:func:`sample_seed`), never from the global RNG the trainer's thread also draws from, so they do not
depend on timing. A batch in flight at a checkpoint is waited for and saved with it
(:mod:`lmppo.runs.trainer_state`): it was sampled by weights the checkpoint no longer holds.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Protocol

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lmppo.inputs.data import Prompt, PromptBatch, PromptStream
from lmppo.modeling.distributed import gathered
from lmppo.modeling.lora import unwrap_model
from lmppo.sampling.rollout import Rollout

# --------------------------------------------------------------------------------------------------
# The protocol every engine follows
# --------------------------------------------------------------------------------------------------


class Generator(Protocol):
    """A rollout engine: :class:`lmppo.sampling.hf_engine.HFGenerator`,
    :class:`lmppo.sampling.hf_engine.SnapshotGenerator` or :class:`lmppo.sampling.vllm_engine.VLLMGenerator`.
    Every engine has all three methods (no optional ones)."""

    def generate(
        self,
        prompts: Sequence[Prompt],
        policy_version: int,
        sample_ids: Sequence[int] | None = None,
        rows: Sequence[dict] | None = None,
    ) -> Rollout:
        """Sample ``prompts`` into a :class:`Rollout` recording ``policy_version`` (or the version its own
        weights hold). ``sample_ids`` place each prompt in the prompt stream; a seeded engine draws from
        them. ``rows``: the prompts' whole rows, which an episode's environment resets on (one sampled
        response needs only its prompt)."""
        ...

    def sync_weights(self, policy: nn.Module, policy_version: int) -> None:
        """Take the trained policy after an update (``RunSpec.engine.owns_weights``; else a no-op: the
        engine samples from the trained module itself)."""
        ...

    def close(self, abandon: bool = False) -> None:
        """Release the engine (vLLM: before the process group ends); ``abandon``: the run failed and a rank
        may be gone, so no collective teardown."""
        ...


def sample_seed(seed: int, sample_id: int, turn: int = 0) -> int:
    """The sampling seed of one response (or of a batch, from its first): the run's seed and the sample's
    place in the prompt stream (and an episode's turn), so a sample draws the same tokens on any number of
    ranks and before and after a resume."""
    return (turn << 56) + (seed << 32) + sample_id


# --------------------------------------------------------------------------------------------------
# The weight stream
# --------------------------------------------------------------------------------------------------


def policy_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights under their transformers checkpoint names, LoRA adapters folded in, one
    tensor at a time. The model is not modified (no merge/unmerge round trip, which would not restore the
    base weights bit for bit and so would move the adapter-disabled reference).

    Under FSDP2 every rank must consume the whole stream in the same order: each unit is all-gathered
    when the stream reaches it and resharded when it moves on.
    """
    base = unwrap_model(model)  # a peft model's transformers model, its layers still holding the adapters
    units = {name: m for name, m in base.named_modules() if name and isinstance(m, FSDPModule)}
    for name, unit in units.items():  # the decoder layers
        with gathered(unit, nested=False):
            yield from _folded_weights(unit, name, skip=())
    roots = [m for m in model.modules() if isinstance(m, FSDPModule) and m not in units.values()]
    with gathered(*roots, nested=False):  # the rest: embeddings, final norm, LM head
        yield from _folded_weights(base, "", skip=tuple(units))


def _folded_weights(
    module: nn.Module, prefix: str, skip: tuple[str, ...]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``module``'s weights (named from ``prefix``), adapted layers folded, subtrees named in ``skip`` left out."""

    def kept(name: str) -> bool:
        return not any(name == s or name.startswith(s + ".") for s in skip)

    with torch.no_grad():
        for name, sub in module.named_modules(prefix=prefix):
            if isinstance(sub, BaseTunerLayer) and kept(name):
                layer = sub.get_base_layer()
                delta = sum(sub.get_delta_weight(adapter) for adapter in sub.active_adapters)
                yield f"{name}.weight", (layer.weight.float() + delta).to(layer.weight.dtype)
        for name, param in module.named_parameters(prefix=prefix):
            if kept(name) and "lora_" not in name and not name.endswith(".base_layer.weight"):
                yield name.replace(".base_layer.", "."), param.detach()


# --------------------------------------------------------------------------------------------------
# One-step-off rollouts
# --------------------------------------------------------------------------------------------------


class RolloutsAhead:
    """``rollout.asynchronous``: the next batch sampled on a worker thread while the trainer works.

    :meth:`start_next` draws the next prompts and samples them in the background with the engine's
    current weights; :meth:`take` hands that rollout over (waiting if it is not done). The engine's
    weights must not change while it samples: :meth:`finished` waits for the batch in flight, which
    the trainer does before each weight sync, evaluation and checkpoint.
    """

    def __init__(
        self,
        generator: Generator,
        prompt_stream: PromptStream,
        numerics: Callable[[], AbstractContextManager],
    ) -> None:
        self.generator, self.prompt_stream, self.numerics = generator, prompt_stream, numerics
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="lmppo-rollout")
        self.pending: Future[Rollout] | None = None

    def start_next(self, policy_version: int) -> None:
        """Sample the next batch in the background (the trainer's thread goes on)."""
        batch = self.prompt_stream.next_samples()
        self.pending = self.worker.submit(self._sample, batch, policy_version)

    def _sample(self, batch: PromptBatch, policy_version: int) -> Rollout:
        started = time.perf_counter()
        with self.numerics():  # autocast is per thread: the trainer's does not reach this one
            rollout = self.generator.generate(batch.prompts, policy_version, batch.sample_ids, batch.rows)
        return dataclasses.replace(rollout, generation_s=time.perf_counter() - started)

    def finished(self) -> Rollout | None:
        """The batch in flight once it is done (None: nothing in flight); it stays pending."""
        return None if self.pending is None else self.pending.result()

    def take(self) -> Rollout | None:
        """The batch sampled in the background, or None when there is none (the first step)."""
        rollout, self.pending = self.finished(), None
        return rollout

    def put(self, rollout: Rollout) -> None:
        """A batch sampled before a resume (saved with the checkpoint): the next :meth:`take`."""
        self.pending = Future()
        self.pending.set_result(rollout)

    def close(self, abandon: bool = False) -> None:
        self.worker.shutdown(wait=not abandon, cancel_futures=abandon)
