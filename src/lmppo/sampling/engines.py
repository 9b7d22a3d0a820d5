"""What every rollout engine shares: the :class:`Engine` protocol the engines implement as peers, the
:class:`Generator` protocol the trainer samples rollouts through, the weight stream an engine with its own
copy of the policy is synced from, and one-step-off rollouts.

The engines, one module each and neither a kind of the other: :mod:`lmppo.sampling.hf_engine` (the
transformers decode loop, on the trained policy or a snapshot of it) and :mod:`lmppo.sampling.vllm_engine`.
They sample token ids; the generators turn prompts into rollouts on any engine:
:mod:`lmppo.sampling.responses` (one response per prompt) and :mod:`lmppo.sampling.episodes` (an
environment's episodes), both rendering with :class:`lmppo.sampling.prompts.PromptRenderer`.
``RunSpec.engine`` says which engine a run builds (:func:`lmppo.runs.build.build_generator`, the one place
that names an engine class) and whether it owns its weights.

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
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lmppo.errors import LmppoError, warn
from lmppo.inputs.data import Prompt, PromptBatch, PromptStream
from lmppo.modeling.distributed import gathered
from lmppo.modeling.lora import unwrap_model
from lmppo.sampling.prompts import PromptRenderer
from lmppo.sampling.rollout import Rollout

# --------------------------------------------------------------------------------------------------
# The engines' protocol and the generators' protocol
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingSettings:
    """How every engine samples (``rollout.*``): only temperature, top-k and top-p shape the distribution (a
    checkpoint's ``generation_config`` is never read); a response ends at a stop token or after
    ``max_new_tokens``."""

    max_new_tokens: int
    stop_token_ids: tuple[int, ...]  # the tokenizer's EOS and rollout.stop_token_ids, sorted
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @classmethod
    def of(
        cls,
        tokenizer,
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        stop_token_ids: Sequence[int] | None = None,
    ) -> SamplingSettings:
        """The settings, checked; the stop tokens are ``stop_token_ids`` and the tokenizer's EOS."""
        if temperature <= 0:
            raise LmppoError(f"temperature must be > 0 for PPO sampling, got {temperature}.")
        if max_new_tokens < 1 or top_k < 0 or not 0 < top_p <= 1:
            raise LmppoError(
                f"need max_new_tokens >= 1, top_k >= 0, 0 < top_p <= 1; got {max_new_tokens}, {top_k}, {top_p}."
            )
        stops = {int(i) for i in stop_token_ids or []}
        if tokenizer.eos_token_id is not None:
            stops.add(tokenizer.eos_token_id)
        if not stops:
            raise LmppoError("the tokenizer has no EOS token; give `stop_token_ids` so responses can end.")
        if top_k > 0 or top_p < 1.0:
            warn(
                f"top_k={top_k} / top_p={top_p}: tokens are drawn from the truncated distribution but logp_old "
                "and the update's log-probs are of the untruncated tempered one, so the first ratio is 1 while "
                "the samples are slightly off-policy for the distribution PPO optimises (rare tokens are "
                "never drawn)."
            )
        return cls(max_new_tokens, tuple(sorted(stops)), temperature, top_k, top_p)

    def pad_token_id(self, tokenizer) -> int:
        """The id that fills a finished row: the tokenizer's pad token, else the lowest stop token."""
        return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_token_ids[0]


def sampling_parts(
    model: nn.Module,
    tokenizer,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_token_ids: Sequence[int] | None = None,
    chat_template: str | None = None,
    raw_prompts: bool = False,
    max_prompt_length: int | None = None,
    truncate_prompts: bool = False,
) -> tuple[SamplingSettings, PromptRenderer]:
    """How an engine samples for ``model`` and how its prompts render, from the sampling keywords
    (:func:`lmppo.runs.build.generator_options` gives them from a config): the prompts' room is what
    ``model``'s context window leaves beside ``max_new_tokens``."""
    settings = SamplingSettings.of(
        tokenizer,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        stop_token_ids=stop_token_ids,
    )
    renderer = PromptRenderer(
        tokenizer,
        pad_token_id=settings.pad_token_id(tokenizer),
        context=getattr(model.config, "max_position_embeddings", None),
        max_new_tokens=max_new_tokens,
        chat_template=chat_template,
        raw_prompts=raw_prompts,
        max_prompt_length=max_prompt_length,
        truncate_prompts=truncate_prompts,
    )
    return settings, renderer


class Samples(NamedTuple):
    """One batch of samples as an engine drew them: ``response_ids`` (B, R') after each query, the pad id
    past a row's stop token; ``logp_old`` (B, R') at the sampling temperature; with a critic on the
    sampling trunk its ``values`` (B, R' + 1), else None."""

    response_ids: torch.Tensor
    logp_old: torch.Tensor
    values: torch.Tensor | None = None


@dataclass
class DecodeBudget:
    """An engine's decode batches, sized in cache positions: what out-of-memory recovery halves."""

    tokens: int | None = None  # rollout.generation_batch_tokens: positions per decode batch (None: all rows)
    in_progress: int = 0  # positions of the decode batch running now (what ran out, on out-of-memory)


class Engine(Protocol):
    """What samples tokens: :class:`lmppo.sampling.hf_engine.DecodeLoop` (transformers) or
    :class:`lmppo.sampling.vllm_engine.VLLMEngine`. An engine knows token ids only; prompts and episodes
    are the generators' (:class:`Generator`)."""

    settings: SamplingSettings
    pad_token_id: int
    device: torch.device  # where its samples are returned
    owns_weights: bool  # samples from its own copy of the policy, synced after each update
    decode_budget: DecodeBudget | None  # None: its batches cannot shrink (vLLM: its cache is set at load)
    memory_remedy: str  # what frees memory for it when it runs out (the config keys to change)

    def sample(
        self,
        query_ids: torch.Tensor,
        query_mask: torch.Tensor,
        sample_ids: Sequence[int],
        max_new_tokens: int | None = None,
        turn: int = 0,
    ) -> Samples:
        """Sample after each left-padded query, at most ``max_new_tokens`` (default: the settings')
        tokens; ``sample_ids`` (and an episode's ``turn``) seed a seeded engine's draws."""
        ...

    def version_sampled(self, policy_version: int) -> int:
        """The policy version a sample drawn now holds (an engine with its own weights: its last sync's)."""
        ...

    def sync_weights(self, policy: nn.Module, policy_version: int) -> None:
        """Take the trained policy after an update (a no-op unless ``owns_weights``)."""
        ...

    def sleep(self) -> None:
        """Free what the engine holds between batches (vLLM's sleep mode); it wakes at its next call."""
        ...

    def close(self, abandon: bool = False) -> None:
        """Release the engine (vLLM: before the process group ends); ``abandon``: the run failed and a rank
        may be gone, so no collective teardown."""
        ...


class Generator(Protocol):
    """What the trainer, the pre-flight and evaluation sample rollouts through, on any :class:`Engine`:
    :class:`lmppo.sampling.responses.ResponseGenerator` (one response per prompt) or
    :class:`lmppo.sampling.episodes.EpisodeGenerator` (an environment's episodes), both :class:`OnEngine`."""

    engine: Engine
    renderer: PromptRenderer

    @property
    def decode_budget(self) -> DecodeBudget | None:
        """The engine's decode budget, which generation's out-of-memory recovery halves (None: it cannot)."""
        ...

    def generate(
        self,
        prompts: Sequence[Prompt],
        policy_version: int,
        sample_ids: Sequence[int] | None = None,
        rows: Sequence[dict] | None = None,
    ) -> Rollout:
        """Sample ``prompts`` into a :class:`Rollout` recording ``policy_version`` (or the version the engine's
        own weights hold). ``sample_ids`` place each prompt in the prompt stream; a seeded engine draws from
        them. ``rows``: the prompts' whole rows (default: ``{"prompt": prompt}``), what an episode's
        environment resets on."""
        ...

    def sync_weights(self, policy: nn.Module, policy_version: int) -> None:
        """The engine's :meth:`Engine.sync_weights`."""
        ...

    def close(self, abandon: bool = False) -> None:
        """The engine's :meth:`Engine.close`."""
        ...


class OnEngine:
    """What a generator hands straight to its engine (``self.engine``): the decode budget, the weight sync
    and closing."""

    engine: Engine

    @property
    def decode_budget(self) -> DecodeBudget | None:
        return self.engine.decode_budget

    def sync_weights(self, policy: nn.Module, policy_version: int) -> None:
        self.engine.sync_weights(policy, policy_version)

    def close(self, abandon: bool = False) -> None:
        self.engine.close(abandon)


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
