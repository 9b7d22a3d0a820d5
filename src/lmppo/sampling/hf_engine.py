"""The transformers rollout engine (``rollout.engine: hf``), :class:`DecodeLoop`: a decode loop on a static KV
cache over the trained policy itself, or, under ``rollout.asynchronous``, over a snapshot of it that each
update overwrites.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence

import torch
from torch import nn
from transformers import StaticCache, TopKLogitsWarper, TopPLogitsWarper
from transformers.cache_utils import StaticLayer

from lmppo.modeling.lora import lora_merged, unwrap_model
from lmppo.modeling.models import ValueModel, eval_mode
from lmppo.progress import advance
from lmppo.sampling.engines import (
    DecodeBudget,
    Samples,
    SamplingSettings,
    policy_weights,
    sample_seed,
    sampling_parts,
)
from lmppo.sampling.responses import ResponseGenerator


def _cache_argument(model) -> str:
    """The forward's KV-cache argument: ``cache`` from transformers 5.2x (``past_key_values`` is its
    deprecated alias), ``past_key_values`` before. A name the forward does not know would be swallowed
    by ``**kwargs`` and the loop would silently decode without a cache."""
    parameters = inspect.signature(unwrap_model(model).forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def static_cache(config, max_cache_len: int) -> StaticCache:
    """A KV cache sized once for the whole decode. Under bf16 autocast the keys leave RoPE in fp32 (the
    residual stream is fp32) and the values leave their projection in bf16; transformers before 5.2x
    allocated both in the keys' dtype and then refused the bf16 values. There the values are cast to the
    keys' dtype as they go in (exact: attention casts both to bf16 again under autocast)."""
    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    if not _static_cache_keeps_value_dtype():
        for layer in cache.layers:
            layer.update = functools.partial(_values_in_key_dtype, layer.update)
    return cache


@functools.cache
def _static_cache_keeps_value_dtype() -> bool:
    layer = StaticLayer(max_cache_len=1)
    layer.lazy_initialization(torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1, dtype=torch.bfloat16))
    return layer.values.dtype == torch.bfloat16


def _values_in_key_dtype(update, key_states, value_states, *args, **kwargs):
    return update(key_states, value_states.to(key_states.dtype), *args, **kwargs)


def hf_generator(
    model: nn.Module,
    tokenizer,
    *,
    value_model: ValueModel | None = None,
    bootstrap_values: bool = True,
    seed: int | None = None,
    batch_tokens: int | None = None,
    owns_weights: bool = False,
    **options,
) -> ResponseGenerator:
    """One response per prompt from the decode loop on ``model``: :class:`DecodeLoop`'s keywords, and the
    sampling ones of :func:`~lmppo.sampling.engines.sampling_parts` (``options``)."""
    settings, renderer = sampling_parts(model, tokenizer, **options)
    loop = DecodeLoop(
        model,
        settings,
        pad_token_id=renderer.pad_token_id,
        value_model=value_model,
        bootstrap_values=bootstrap_values,
        seed=seed,
        batch_tokens=batch_tokens,
        owns_weights=owns_weights,
    )
    return ResponseGenerator(loop, renderer)


class DecodeLoop:
    """The transformers engine: samples from a causal LM, one decode step per token on a static KV cache.

    The loop is ours rather than ``model.generate``: the cache is a ``StaticCache`` sized for the prompt plus
    ``max_new_tokens`` (a ``DynamicCache`` concatenates every layer's keys and values at every step, a cost
    quadratic in the response length), there is no per-step machinery beyond the forward and the draw, and
    ``logp_old`` comes from the logits the token is drawn from. LoRA adapters are folded into a temporary copy
    of their base weights for the loop (:func:`~lmppo.modeling.lora.lora_merged`). The draw is transformers'
    own (tempered scores, top-k, top-p, ``torch.multinomial``), so a seed gives the same tokens as
    ``model.generate`` would.

    ``seed`` (default: none) draws each batch from its own stream, seeded by ``seed`` and the batch's first
    sample id, instead of the global RNG (an engine sampling on another thread than the trainer's).

    ``owns_weights``: ``model`` is a plain copy of the policy's transformers model (``engine: hf`` with
    ``rollout.asynchronous``, where the trained module changes while the next batch is sampled) that
    :meth:`sync_weights` overwrites after each update; else ``model`` is the trained policy itself.

    With ``value_model`` (a head on this policy's own trunk, :meth:`ValueModel.shared_trunk`) the loop also
    reads the values off the last hidden states it computes anyway (:class:`~lmppo.sampling.engines.Samples`),
    so the trainer skips its values pass. A truncated row's bootstrap costs one more decode step;
    ``bootstrap_values=False`` (a run whose truncation is terminal, which never reads it) skips that step.
    """

    memory_remedy = "smaller decode batches (rollout.generation_batch_tokens)"

    def __init__(
        self,
        model: nn.Module,
        settings: SamplingSettings,
        *,
        pad_token_id: int,
        value_model: ValueModel | None = None,
        bootstrap_values: bool = True,
        seed: int | None = None,
        batch_tokens: int | None = None,
        owns_weights: bool = False,
    ) -> None:
        if value_model is not None and not value_model.shared_trunk:
            raise ValueError("the decode loop reads values only from a head on the policy's own trunk")
        if owns_weights:
            model = model.eval().requires_grad_(False)
        self.model, self.settings, self.pad_token_id = model, settings, pad_token_id
        self.value_model, self.bootstrap_values, self.seed = value_model, bootstrap_values, seed
        self.decode_budget = DecodeBudget(batch_tokens)  # the run halves it on out-of-memory
        self.owns_weights, self.synced_version = owns_weights, 0

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def version_sampled(self, policy_version: int) -> int:
        return self.synced_version if self.owns_weights else policy_version

    def sync_weights(self, policy: nn.Module, policy_version: int) -> None:
        """Overwrite the snapshot with ``policy``'s weights (nothing to do on the trained module itself)."""
        if not self.owns_weights:
            return
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in policy_weights(policy):
                params[name].copy_(tensor)
        self.synced_version = policy_version

    def sleep(self) -> None:
        """Nothing to free: the cache lives for one batch."""

    def close(self, abandon: bool = False) -> None:
        """Nothing to release."""

    def sample(
        self,
        query_ids: torch.Tensor,
        query_mask: torch.Tensor,
        sample_ids: Sequence[int],
        max_new_tokens: int | None = None,
        turn: int = 0,
    ) -> Samples:
        """The decode loop's samples (:class:`~lmppo.sampling.engines.Engine`)."""
        with torch.inference_mode():
            response_ids, logp_old, values = self._sample(
                query_ids, query_mask, list(sample_ids), max_new_tokens, turn
            )
        # clone outside inference mode: the PPO update feeds these to autograd, which rejects inference tensors
        return Samples(response_ids.clone(), logp_old.clone(), values)

    def _sample(
        self,
        query_ids: torch.Tensor,
        query_mask: torch.Tensor,
        sample_ids: list[int],
        max_new_tokens: int | None = None,
        turn: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The decode loop on ``self.model`` in eval mode, its LoRA adapters folded for the loop, over
        batches of rows whose static caches hold at most ``batch_tokens`` positions (all rows at once when
        unset)."""
        max_new_tokens = max_new_tokens or self.settings.max_new_tokens
        rows, budget = len(query_ids), self.decode_budget
        if budget.tokens:  # rows of at most budget.tokens cache positions per decode batch
            rows = max(1, budget.tokens // (query_ids.shape[1] + max_new_tokens))
        pieces = []
        with eval_mode(self.model), lora_merged(self.model):
            for start in range(0, len(query_ids), rows):
                part = slice(start, start + rows)
                first = int(query_mask[part].any(dim=0).long().argmax())  # this batch's left padding goes
                queries, mask = query_ids[part, first:], query_mask[part, first:]
                budget.in_progress = len(queries) * (queries.shape[1] + max_new_tokens)
                pieces.append(self._decode_loop(queries, mask, sample_ids[part], max_new_tokens, turn))
        if len(pieces) == 1:
            return pieces[0]
        return self._joined(pieces)

    def _joined(self, pieces: list[tuple]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The decode batches' tokens, log-probs and values as one batch, each padded to the longest (pad
        id, 0: columns past a row's stop, never read)."""
        width = max(tokens.shape[1] for tokens, _, _ in pieces)

        def padded(t: torch.Tensor, extra: int, value) -> torch.Tensor:
            return torch.nn.functional.pad(t, (0, width + extra - t.shape[1]), value=value)

        tokens = torch.cat([padded(t, 0, self.pad_token_id) for t, _, _ in pieces])
        logps = torch.cat([padded(lp, 0, 0.0) for _, lp, _ in pieces])
        values = None if pieces[0][2] is None else torch.cat([padded(v, 1, 0.0) for _, _, v in pieces])
        return tokens, logps, values

    def _decode_loop(
        self,
        query_ids: torch.Tensor,
        query_mask: torch.Tensor,
        sample_ids: list[int],
        max_new_tokens: int,
        turn: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Ancestral sampling: a prefill over the queries, then one single-token forward per step.

        Returns ``response_ids`` (B, R') and their log-probs (B, R') at the sampling temperature, with
        R' <= max_new_tokens (the loop ends once every row has emitted a stop token; a finished row is
        filled with the pad id), and with a value model the values (B, R' + 1) of the state before each
        token and after the last one (a truncated row needs one more forward for it, run only with
        ``bootstrap_values``; a column no forward reached is 0). Positions count real tokens only, as in
        :func:`sequence_inputs`. ``turn``: an episode's turn, which a seeded engine's draws also depend on.
        """
        batch, width = query_ids.shape
        device = query_ids.device
        rng = None  # the global RNG, unless seeded
        if self.seed is not None:
            rng = torch.Generator(device).manual_seed(sample_seed(self.seed, sample_ids[0], turn))
        cache = {
            _cache_argument(self.model): static_cache(
                unwrap_model(self.model).config, max_cache_len=width + max_new_tokens
            )
        }
        attention_mask = torch.zeros(batch, width + max_new_tokens, dtype=torch.long, device=device)
        attention_mask[:, :width] = query_mask
        positions = (query_mask.cumsum(dim=1) - 1).clamp(min=0)
        values = []  # with a value model: V of the state each forward ends in, one (B,) per forward

        def forward(input_ids, position_ids, cache_position) -> torch.Tensor:
            # The last position as an index, not logits_to_keep=1: for the prefill, hidden[:, -1:] is a
            # strided view, and a linear on it falls back to a batched matmul over an expanded LM head
            # (SmolLM2, batch 16: 4x slower in fp32, 100x in bf16); an index copies the B rows instead.
            last = torch.tensor([input_ids.shape[1] - 1], device=device)
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                **cache,
                cache_position=cache_position,
                logits_to_keep=last,
                use_cache=True,
                output_hidden_states=self.value_model is not None,
            )
            if self.value_model is not None:
                values.append(self.value_model.values(out.hidden_states[-1][:, -1:]).squeeze(1))
            return out.logits[:, -1]

        logits = forward(query_ids, positions, torch.arange(width, device=device))
        stops = torch.tensor(self.settings.stop_token_ids, device=device)
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        position = positions[:, -1:]
        tokens, logps = [], []
        for step in range(max_new_tokens):
            advance("token", step + 1, max_new_tokens)
            token, logp = self._draw(logits, rng)
            token = token.masked_fill(finished, self.pad_token_id)
            tokens.append(token)
            logps.append(logp)
            finished |= torch.isin(token, stops)
            last = step + 1 == max_new_tokens or finished.all()
            if last and (self.value_model is None or finished.all() or not self.bootstrap_values):
                break
            cursor = width + step
            attention_mask[:, cursor] = 1
            position = position + 1
            logits = forward(token[:, None], position, torch.tensor([cursor], device=device))
            if last:  # that forward was only for the truncated rows' V(s_after)
                break
        if self.value_model is None:
            return torch.stack(tokens, dim=1), torch.stack(logps, dim=1), None
        values += [torch.zeros_like(values[0])] * (len(tokens) + 1 - len(values))  # finished: never read
        return torch.stack(tokens, dim=1), torch.stack(logps, dim=1), torch.stack(values, dim=1)

    def _draw(
        self, logits: torch.Tensor, rng: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row from ``softmax(logits / T)`` (top-k / top-p applied) and its untruncated log-prob."""
        settings = self.settings
        scores = logits.float() / settings.temperature
        logp = torch.log_softmax(scores, dim=-1)
        if settings.top_k:
            scores = TopKLogitsWarper(settings.top_k)(None, scores)
        if settings.top_p < 1.0:
            scores = TopPLogitsWarper(settings.top_p)(None, scores)
        token = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1, generator=rng).squeeze(1)
        return token, logp.gather(1, token[:, None]).squeeze(1)
