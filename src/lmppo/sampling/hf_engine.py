"""The transformers rollout engine (``rollout.engine: hf``): a decode loop on a static KV cache over the
trained policy itself (:class:`HFGenerator`), or, under ``rollout.asynchronous``, over a snapshot of it that
each update overwrites (:class:`SnapshotGenerator`).
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Sequence

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase, StaticCache, TopKLogitsWarper, TopPLogitsWarper
from transformers.cache_utils import StaticLayer

from lmppo.errors import LmppoError, warn
from lmppo.inputs.data import Prompt, check_chat_template, render_query_ids
from lmppo.math.core import last_response_index
from lmppo.modeling.lora import lora_merged, unwrap_model
from lmppo.modeling.models import ValueModel, eval_mode
from lmppo.progress import advance
from lmppo.sampling.engines import policy_weights, sample_seed
from lmppo.sampling.rollout import Rollout, response_mask_from_ids


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


def prompt_room(
    context: int | None,
    max_new_tokens: int,
    max_prompt_length: int | None,
    key: str = "rollout.max_new_tokens",
) -> int | None:
    """Tokens a rendered prompt may take in a ``context``-token window (None: no limit known) next to
    ``max_new_tokens`` of response (the config's ``key``; an episode's: ``rollout.max_total_tokens``):
    ``data.max_prompt_length`` when set, else the rest of the window."""
    if context is not None and max_new_tokens >= context:
        raise LmppoError(
            f"{key}={max_new_tokens} leaves no room for a prompt in the policy's {context}-token context window "
            f"(max_position_embeddings); set {key} below {context}"
        )
    room = None if context is None else context - max_new_tokens
    if max_prompt_length is None:
        return room
    if room is not None and max_prompt_length > room:
        raise LmppoError(
            f"data.max_prompt_length={max_prompt_length} + {key}={max_new_tokens} exceeds the policy's "
            f"{context}-token context window; lower one of them"
        )
    return max_prompt_length


class HFGenerator:
    """Samples responses from a transformers causal LM, one decode step per token on a static KV cache.

    Prompts are rendered with the tokenizer's own chat template (or ``chat_template``) and
    ``add_generation_prompt=True``; ``raw_prompts=True`` tokenises prompt strings as they are. Only
    temperature, top-k and top-p shape the sampling distribution (the checkpoint's ``generation_config``
    is never read: no repetition penalty, min length, suppressed tokens, ...). Generation stops at the
    tokenizer's EOS and ``stop_token_ids``, or after ``max_new_tokens``.

    The loop is ours rather than ``model.generate``: the cache is a ``StaticCache`` sized for the prompt plus
    ``max_new_tokens`` (a ``DynamicCache`` concatenates every layer's keys and values at every step, a cost
    quadratic in the response length), there is no per-step machinery beyond the forward and the draw, and
    ``logp_old`` comes from the logits the token is drawn from. LoRA adapters are folded into a temporary copy
    of their base weights for the loop (:func:`~lmppo.modeling.lora.lora_merged`). The draw is transformers'
    own (tempered scores, top-k, top-p, ``torch.multinomial``), so a seed gives the same tokens as
    ``model.generate`` would.

    ``seed`` (default: none) draws each batch from its own stream, seeded by ``seed`` and the batch's first
    sample id, instead of the global RNG (an engine sampling on another thread than the trainer's).

    A rendered prompt longer than ``max_prompt_length`` (default: the context window minus
    ``max_new_tokens``) is an error naming the row, unless ``truncate_prompts`` keeps its last tokens.

    With ``value_model`` (a head on this policy's own trunk, :meth:`ValueModel.shared_trunk`) the loop also
    reads the values off the last hidden states it computes anyway: ``rollout.values`` and
    ``rollout.bootstrap_value`` as :func:`value_predictions` defines them, so the trainer skips its values
    pass. A truncated row's bootstrap costs one more decode step; ``bootstrap_values=False`` (a run whose
    truncation is terminal, which never reads it) skips that step and leaves the bootstrap 0.
    """

    def __init__(
        self,
        model,
        tokenizer: PreTrainedTokenizerBase,
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
        value_model: ValueModel | None = None,
        bootstrap_values: bool = True,
        seed: int | None = None,
        batch_tokens: int | None = None,
    ) -> None:
        if value_model is not None and not value_model.shared_trunk:
            raise ValueError("HFGenerator reads values only from a head on the policy's own trunk")
        if temperature <= 0:
            raise LmppoError(f"temperature must be > 0 for PPO sampling, got {temperature}.")
        if max_new_tokens < 1 or top_k < 0 or not 0 < top_p <= 1:
            raise LmppoError(
                f"need max_new_tokens >= 1, top_k >= 0, 0 < top_p <= 1; got {max_new_tokens}, {top_k}, {top_p}."
            )
        if not raw_prompts:
            check_chat_template(tokenizer, chat_template)
        stops = {int(i) for i in stop_token_ids or []}
        if tokenizer.eos_token_id is not None:
            stops.add(tokenizer.eos_token_id)
        if not stops:
            raise LmppoError("the tokenizer has no EOS token; give `stop_token_ids` so responses can end.")
        self.model, self.tokenizer, self.value_model = model, tokenizer, value_model
        self.bootstrap_values, self.seed = bootstrap_values, seed
        self.max_new_tokens = max_new_tokens
        self.batch_tokens = batch_tokens  # rollout.generation_batch_tokens; the run halves it on OOM
        self.decode_tokens = 0  # positions of the decode batch in progress (what ran out, on OOM)
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.stop_token_ids = sorted(stops)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stops)
        self.chat_template, self.raw_prompts = chat_template, raw_prompts
        self.truncate_prompts = truncate_prompts
        self.max_prompt_length = self._prompt_limit(max_prompt_length)
        if top_k > 0 or top_p < 1.0:
            warn(
                f"top_k={top_k} / top_p={top_p}: tokens are drawn from the truncated distribution but logp_old "
                "and the update's log-probs are of the untruncated tempered one, so the first ratio is 1 while "
                "the samples are slightly off-policy for the distribution PPO optimises (rare tokens are "
                "never drawn)."
            )

    def sync_weights(self, policy: nn.Module, policy_version: int) -> None:
        """Nothing to sync: the loop samples from the trained module itself."""

    def version_sampled(self, policy_version: int) -> int:
        """The policy version a rollout sampled now holds: the trainer's (an engine with its own weights: the
        version it was last synced to)."""
        return policy_version

    def close(self, abandon: bool = False) -> None:
        """Nothing to release: the cache lives for one batch."""

    def _prompt_limit(self, max_prompt_length: int | None) -> int | None:
        context = getattr(self.model.config, "max_position_embeddings", None)
        return prompt_room(context, self.max_new_tokens, max_prompt_length)

    def render(self, prompt: Prompt) -> list[int]:
        """Token ids of one prompt, ready for generation (chat template with the generation prompt)."""
        if self.raw_prompts:
            if not isinstance(prompt, str):
                raise LmppoError("raw_prompts needs plain-text prompts, got chat messages.")
            return self.tokenizer(prompt).input_ids
        return render_query_ids(self.tokenizer, prompt, self.chat_template)

    def query_ids(self, prompt: Prompt, where: str) -> list[int]:
        """The ids generation starts from: rendered, checked, cut to ``max_prompt_length`` if allowed.
        ``where`` names the prompt in errors (a file and line, when the caller knows them)."""
        ids = self.render(prompt)
        if not ids:
            raise LmppoError(f"{where} renders to no tokens; the model needs at least one to condition on.")
        if self.max_prompt_length is not None and len(ids) > self.max_prompt_length:
            if not self.truncate_prompts:
                raise LmppoError(
                    f"{where} is {len(ids)} tokens after rendering, over the limit of {self.max_prompt_length} "
                    f"(context window minus max_new_tokens={self.max_new_tokens}). Shorten it, or set "
                    "`data.truncate_prompts: true` to keep its last tokens."
                )
            ids = ids[-self.max_prompt_length :]  # keep the end: it holds the generation prompt
        return ids

    def _query_batch(self, prompts: Sequence[Prompt]) -> tuple[torch.Tensor, torch.Tensor]:
        if not prompts:
            raise LmppoError("no prompts to generate from.")
        rows = [self.query_ids(prompt, where=f"prompt {i} of the batch") for i, prompt in enumerate(prompts)]
        return self.left_padded(rows)

    def left_padded(self, rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(query_ids, query_mask)``, each (B, longest row), the rows left-padded."""
        width = max(len(ids) for ids in rows)
        query_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        query_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, ids in enumerate(rows):
            query_ids[i, width - len(ids) :] = torch.tensor(ids)
            query_mask[i, width - len(ids) :] = 1
        return query_ids, query_mask

    def generate(
        self,
        prompts: Sequence[Prompt],
        policy_version: int,
        sample_ids: Sequence[int] | None = None,
        rows: Sequence[dict] | None = None,
    ) -> Rollout:
        """Sample one response per prompt (``rows``, for an environment, unused); ``logp_old`` is recorded
        while sampling."""
        device = next(self.model.parameters()).device
        query_ids, query_mask = (t.to(device) for t in self._query_batch(prompts))
        sample_ids = list(range(len(prompts))) if sample_ids is None else list(sample_ids)
        with torch.inference_mode():
            response_ids, logp_old, values = self._sample(query_ids, query_mask, sample_ids)
        # clone outside inference mode: the PPO update feeds these to autograd, which rejects inference tensors
        response_ids, logp_old = response_ids.clone(), logp_old.clone()
        response_mask, terminated = response_mask_from_ids(response_ids, self.stop_token_ids)
        estimates = {}
        if values is not None:  # (B, R' + 1): V before each response token, then after the last column
            after_last = values.gather(1, (last_response_index(response_mask) + 1).unsqueeze(1)).squeeze(1)
            estimates = {
                "values": values[:, :-1].clone(),
                "bootstrap_value": torch.where(terminated, 0.0, after_last),
            }
        return Rollout(
            query_ids=query_ids,
            query_mask=query_mask,
            response_ids=response_ids,
            response_mask=response_mask,
            terminated=terminated,
            logp_old=logp_old,
            policy_version=self.version_sampled(policy_version),
            created_at=time.time(),
            prompts=list(prompts),
            response_texts=self._decode(response_ids, response_mask, terminated),
            temperature=self.temperature,
            **estimates,
        )

    def sample_turns(
        self, contexts: Sequence[Sequence[int]], sample_ids: Sequence[int], turn: int, max_new_tokens: int
    ) -> list[tuple[list[int], list[float]]]:
        """One turn of each live episode (:mod:`lmppo.sampling.episodes`): sampled after ``contexts``, the token
        ids of each episode so far, at most ``max_new_tokens`` each. Each row's tokens up to and including
        its stop token (all of them when it was cut) and their log-probs at the sampling temperature."""
        device = next(self.model.parameters()).device
        query_ids, query_mask = (t.to(device) for t in self.left_padded(contexts))
        with torch.inference_mode():
            response_ids, logp_old, _ = self._sample(
                query_ids, query_mask, list(sample_ids), max_new_tokens, turn
            )
        response_mask, _ = response_mask_from_ids(response_ids, self.stop_token_ids)
        lengths = response_mask.sum(dim=1).long().tolist()
        return [
            (ids[:n].tolist(), logp[:n].tolist()) for ids, logp, n in zip(response_ids, logp_old, lengths)
        ]

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
        unset). An engine that overrides this never touches the trained module: with
        ``rollout.asynchronous`` it samples while the update trains that module on another thread."""
        max_new_tokens = max_new_tokens or self.max_new_tokens
        rows = len(query_ids)
        if self.batch_tokens:  # rows of at most batch_tokens cache positions per decode batch
            rows = max(1, self.batch_tokens // (query_ids.shape[1] + max_new_tokens))
        pieces = []
        with eval_mode(self.model), lora_merged(self.model):
            for start in range(0, len(query_ids), rows):
                part = slice(start, start + rows)
                first = int(query_mask[part].any(dim=0).long().argmax())  # this batch's left padding goes
                queries, mask = query_ids[part, first:], query_mask[part, first:]
                self.decode_tokens = len(queries) * (queries.shape[1] + max_new_tokens)
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
        stops = torch.tensor(self.stop_token_ids, device=device)
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
        scores = logits.float() / self.temperature
        logp = torch.log_softmax(scores, dim=-1)
        if self.top_k:
            scores = TopKLogitsWarper(self.top_k)(None, scores)
        if self.top_p < 1.0:
            scores = TopPLogitsWarper(self.top_p)(None, scores)
        token = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1, generator=rng).squeeze(1)
        return token, logp.gather(1, token[:, None]).squeeze(1)

    def _decode(
        self, response_ids: torch.Tensor, response_mask: torch.Tensor, terminated: torch.Tensor
    ) -> list[str]:
        """Response texts up to but excluding the stop token, special tokens dropped (what a user sees)."""
        lengths = response_mask.sum(dim=1).long() - terminated.long()
        rows = [ids[:n].tolist() for ids, n in zip(response_ids, lengths)]
        return self.tokenizer.batch_decode(rows, skip_special_tokens=True)


class SnapshotGenerator(HFGenerator):
    """:class:`HFGenerator` on ``snapshot``, a plain copy of the policy's transformers model that
    :meth:`sync_weights` overwrites after each update: ``engine: hf`` with ``rollout.asynchronous``, where
    the trained module changes while the next batch is sampled. Costs one more copy of the policy's
    weights; its draws are seeded per batch (``seed``)."""

    def __init__(self, snapshot: nn.Module, tokenizer, *, seed: int, **options) -> None:
        super().__init__(snapshot.eval().requires_grad_(False), tokenizer, seed=seed, **options)
        self.synced_version = 0

    def version_sampled(self, policy_version: int) -> int:
        return self.synced_version

    def sync_weights(self, policy: nn.Module, policy_version: int) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in policy_weights(policy):
                params[name].copy_(tensor)
        self.synced_version = policy_version
