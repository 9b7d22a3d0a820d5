"""Rollouts: sampling responses from the policy and the stored forward passes over them.

Layout (see docs/rollout.md): queries are left-padded ``(B, Q)``; per-token tensors are ``(B, R)`` over
response positions. ``logp_old[:, t] = log pi(response[t] | query, response[:t])`` at the sampling
temperature; ``values[:, t]`` is V of the state before response token ``t``; ``response_mask`` is 1 on
generated tokens up to and including the first stop token.

Every forward over a (query, response) batch goes through :func:`sequence_inputs`: the attention mask
comes from the tokenizer (never from ``ids != pad``, which hides a real EOS when pad == EOS) and
``position_ids`` are explicit (left padding without them shifts positions).

This module owns what is done to a :class:`Rollout`: sampling it, the stored passes over it
(:func:`sequence_logprobs`, :func:`value_predictions`), cutting it into trimmed micro-batches and the
update's forward (:class:`PolicyAndValue`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase, StaticCache, TopKLogitsWarper, TopPLogitsWarper
from transformers.cache_utils import StaticLayer

from lmppo import core
from lmppo.core import last_response_index
from lmppo.data import Prompt, check_chat_template, render_query_ids
from lmppo.distributed import gather_objects
from lmppo.errors import LmppoError, warn
from lmppo.lora import lora_merged, unwrap_model
from lmppo.models import ValueModel, checkpointed_layers, checkpointing, eval_mode
from lmppo.progress import advance

# --------------------------------------------------------------------------------------------------
# The rollout batch
# --------------------------------------------------------------------------------------------------


@dataclass
class Rollout:
    """One batch of sampled responses with everything PPO needs from the sampling policy.

    Tensors: ``query_ids`` (B, Q) long, left-padded; ``query_mask`` (B, Q) long, 1 = real prompt token;
    ``response_ids`` (B, R) long; ``response_mask`` (B, R) float; ``terminated`` (B,) bool (emitted a
    stop token; else truncated at ``max_new_tokens``); ``logp_old`` (B, R) float32 at ``temperature``, as
    the sampler recorded them. The estimates are filled in later, all (B, R) but ``bootstrap_value`` (B,);
    like the tensors above they follow :meth:`select`, :meth:`minibatches`, :meth:`to` and trimming.
    """

    query_ids: torch.Tensor
    query_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    terminated: torch.Tensor
    logp_old: torch.Tensor
    policy_version: int
    created_at: float
    prompts: list
    response_texts: list[str]
    temperature: float = 1.0
    generation_s: float = 0.0  # seconds the engine sampled this batch (on a worker thread when asynchronous)
    values: torch.Tensor | None = None  # V before each response token (the decode loop's or a stored pass)
    bootstrap_value: torch.Tensor | None = None  # V after the last token of a truncated row, else 0
    logp_ref: torch.Tensor | None = None
    advantages: torch.Tensor | None = None  # whitened when ppo.whiten_advantages
    returns: torch.Tensor | None = None
    logp_trainer: torch.Tensor | None = None  # ppo.tis_cap: the trainer's own log-probs of the samples
    tis_weights: torch.Tensor | None = None  # ppo.tis_cap: min(p_trainer / p_sampler, cap) per token

    _ROW_TENSORS = ("query_ids", "query_mask", "response_ids", "response_mask", "terminated", "logp_old")
    _ESTIMATES = (
        "values",
        "bootstrap_value",
        "logp_ref",
        "advantages",
        "returns",
        "logp_trainer",
        "tis_weights",
    )

    def __len__(self) -> int:
        return self.query_ids.shape[0]

    @property
    def response_lengths(self) -> torch.Tensor:
        """(B,) long: counted response tokens per row (stop token included)."""
        return self.response_mask.sum(dim=1).long()

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_mask.sum())

    @property
    def logp_old_for_update(self) -> torch.Tensor:
        """The old policy's log-probs that the KL reward and the PPO ratio use: the trainer's own under
        ``ppo.tis_cap`` (the sampler's then only weight the tokens), else the sampler's."""
        return self.logp_trainer if self.logp_trainer is not None else self.logp_old

    def estimates(self) -> dict[str, torch.Tensor]:
        """The estimates filled in so far, by name."""
        return {name: getattr(self, name) for name in self._ESTIMATES if getattr(self, name) is not None}

    def sequence_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(input_ids, attention_mask, position_ids)``, each (B, Q + R), for a forward pass."""
        return sequence_inputs(self.query_ids, self.query_mask, self.response_ids)

    def select(self, index) -> Rollout:
        """The rows ``index`` (ints, slice, bool mask or index tensor) as a new rollout."""
        if isinstance(index, torch.Tensor):
            index = index.cpu()
        rows = torch.arange(len(self))[index].reshape(-1)
        picked = {
            name: getattr(self, name)[rows.to(getattr(self, name).device)] for name in self._ROW_TENSORS
        }
        return dataclasses.replace(
            self,
            **picked,
            prompts=[self.prompts[i] for i in rows.tolist()],
            response_texts=[self.response_texts[i] for i in rows.tolist()],
            **{name: value[rows.to(value.device)] for name, value in self.estimates().items()},
        )

    def minibatches(self, size: int, shuffle_generator: torch.Generator | None = None) -> Iterator[Rollout]:
        """Consecutive minibatches of ``size`` rows (the last may be smaller), shuffled when given a generator."""
        if shuffle_generator is None:
            order = torch.arange(len(self))
        else:
            order = torch.randperm(len(self), generator=shuffle_generator)
        for start in range(0, len(self), size):
            yield self.select(order[start : start + size])

    def to(self, device: torch.device | str) -> Rollout:
        return dataclasses.replace(
            self,
            **{name: getattr(self, name).to(device) for name in self._ROW_TENSORS},
            **{name: value.to(device) for name, value in self.estimates().items()},
        )


def sequence_inputs(
    query_ids: torch.Tensor, query_mask: torch.Tensor, response_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Concatenate a left-padded query (B, Q) and a response (B, R) into forward inputs, each (B, Q + R).

    Every response position is attended, as during generation; positions after a stop token only feed
    later positions, which are masked out. Position ids count real tokens only, as ``generate`` does.
    """
    input_ids = torch.cat([query_ids, response_ids], dim=1)
    attention_mask = torch.cat([query_mask.long(), torch.ones_like(response_ids)], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids


def response_mask_from_ids(
    response_ids: torch.Tensor, stop_token_ids: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Response mask and termination flags from generated ids.

    ``response_mask[b, t] = 1`` for tokens up to and including the first stop token of row b, 0 after
    it (padding, and any later stop or pad token even when pad == EOS). ``terminated[b]``: row b emitted
    a stop token. ``response_ids`` (B, R) -> ``((B, R) float, (B,) bool)``.
    """
    stops = torch.as_tensor(list(stop_token_ids), device=response_ids.device)
    is_stop = torch.isin(response_ids, stops).long()  # (B, R)
    stops_before = is_stop.cumsum(dim=1) - is_stop  # stop tokens strictly before t
    return (stops_before == 0).float(), is_stop.any(dim=1)


# --------------------------------------------------------------------------------------------------
# Forward passes over a rollout
# --------------------------------------------------------------------------------------------------


def response_logits(model, batch: Rollout, temperature: float | None = None) -> torch.Tensor:
    """Logits predicting each response token, divided by the temperature. -> (B, R, V) float32.

    Row ``t`` comes from the position before response token ``t`` (the last query token for t = 0).
    Only those R positions are projected onto the vocabulary (``logits_to_keep``). Runs with whatever
    grad mode and train/eval mode the caller set. ``temperature`` defaults to the rollout's sampling
    temperature. For log-probs use :func:`response_logprobs`, which never makes this tempered copy.
    """
    out, _ = _response_forward(model, batch)
    return _checked(out.logits, batch).float() / _temperature(batch, temperature)


def response_logprobs(
    model, batch: Rollout, temperature: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the response tokens and the policy's entropy at each, under ``model`` at
    ``temperature`` (default: the sampling one). -> (B, R), (B, R) float32.

    The forward of :func:`response_logits`; the temperature and the float32 cast happen chunk by chunk
    inside :func:`lmppo.core.token_logprobs_and_entropy`. The entropy's backward sweep runs only when a
    loss uses it."""
    out, _ = _response_forward(model, batch)
    logits = _checked(out.logits, batch)
    return core.token_logprobs_and_entropy(logits, batch.response_ids, _temperature(batch, temperature))


def policy_logprobs_and_values(
    policy, value_model: ValueModel, batch: Rollout, temperature: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shared trunk: :func:`response_logprobs`' log-probs and entropy, and values (B, R), from ONE
    backbone pass of the policy.

    ``value_model`` must be ``ValueModel.shared_trunk(policy)``; its head reads the policy's last hidden
    state at the same positions as the logits.
    """
    if not value_model.shared_trunk:
        raise ValueError("policy_logprobs_and_values needs a shared-trunk value model; use value_predictions")
    out, keep = _response_forward(policy, batch, output_hidden_states=True)
    values = value_model.values(out.hidden_states[-1][:, keep])  # (B, R)
    logits = _checked(out.logits, batch)
    logp, entropy = core.token_logprobs_and_entropy(
        logits, batch.response_ids, _temperature(batch, temperature)
    )
    return logp, entropy, values


def _response_forward(model, batch: Rollout, **kwargs):
    """One forward over (query, response), projecting only the R positions that predict response tokens."""
    input_ids, attention_mask, position_ids = batch.sequence_inputs()
    queries, responses = batch.query_ids.shape[1], batch.response_ids.shape[1]
    keep = torch.arange(queries - 1, queries + responses - 1, device=input_ids.device)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=keep,
        use_cache=False,
        **kwargs,
    )
    return out, keep


def _checked(logits: torch.Tensor, batch: Rollout) -> torch.Tensor:
    if logits.shape[1] != batch.response_ids.shape[1]:
        raise TypeError(
            "the model ignored `logits_to_keep`; lmppo needs a transformers causal LM that supports it"
        )
    return logits


def _temperature(batch: Rollout, temperature: float | None) -> float:
    return batch.temperature if temperature is None else temperature


def sequence_logprobs(
    model,
    rollout: Rollout,
    temperature: float | None = None,
    *,
    forward_batch_size: int | None = None,
    forward_batch_tokens: int | None = None,
) -> torch.Tensor:
    """Log-probs of the sampled tokens under ``model`` (B, R) float32, eval mode, no grad.

    The stored reference pass (``logp_ref``), and the trainer's own log-probs of engine samples. The
    temperature defaults to the sampling temperature, so the KL compares like with like. Values at
    masked positions are finite but meaningless. Forwards take ``forward_batch_size`` rows or (trimmed)
    ``forward_batch_tokens`` positions at a time.
    """
    pieces = []
    with torch.inference_mode(), eval_mode(model):
        for index, mb in stored_pass_batches(rollout, forward_batch_size, forward_batch_tokens):
            pieces.append((index, response_logprobs(model, mb, temperature)[0]))
        logp = scatter_rows(pieces, len(rollout), rollout.response_ids.shape[1])
    return logp.clone()  # a normal tensor: inference tensors cannot meet autograd later


def state_values(value_model: ValueModel, batch: Rollout) -> torch.Tensor:
    """(B, R + 1): V of the state before each response token, then of the state after the last column."""
    return value_model(*batch.sequence_inputs())[:, batch.query_ids.shape[1] - 1 :]


def value_predictions(
    value_model: ValueModel,
    rollout: Rollout,
    *,
    forward_batch_size: int | None = None,
    forward_batch_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored values for GAE, eval mode, no grad.

    Returns ``values`` (B, R): ``values[:, t] = V(query + response[:t])``, read at the position that
    predicts token t; and ``bootstrap_value`` (B,): V of the state after the row's last response token
    for truncated rows, **0 for terminated rows** (ready for ``core.gae``).
    """
    values, bootstrap = [], []
    with torch.inference_mode(), eval_mode(value_model):
        for index, mb in stored_pass_batches(rollout, forward_batch_size, forward_batch_tokens):
            v = state_values(value_model, mb)
            after_last = v.gather(1, (last_response_index(mb.response_mask) + 1).unsqueeze(1)).squeeze(1)
            values.append((index, v[:, :-1]))
            bootstrap.append((index, torch.where(mb.terminated, 0.0, after_last)[:, None]))
        width = rollout.response_ids.shape[1]
        values, bootstrap = (
            scatter_rows(values, len(rollout), width),
            scatter_rows(bootstrap, len(rollout), 1),
        )
    return values.clone(), bootstrap.squeeze(1).clone()  # normal tensors, not inference ones


class PolicyAndValue(nn.Module):
    """The trained networks behind one ``forward``: the response tokens' log-probs and the policy's
    entropy (B, R) at the sampling temperature (:func:`response_logprobs`), and values (B, R) (None without
    a critic).

    One module so that data parallelism wraps one forward and one set of parameters: DDP then syncs the
    policy's and the critic's gradients in the same backward, and a shared trunk is synced once.
    """

    def __init__(self, policy: nn.Module, value_model: ValueModel | None) -> None:
        super().__init__()
        self.policy, self.value_model = policy, value_model
        self.checkpointed = checkpointed_layers(self)  # ppo.gradient_checkpointing: recomputed in backward

    def forward(self, batch: Rollout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        with checkpointing(self.checkpointed):
            if self.value_model is None:
                return *response_logprobs(self.policy, batch), None
            if self.value_model.shared_trunk:
                return policy_logprobs_and_values(self.policy, self.value_model, batch)
            return *response_logprobs(self.policy, batch), state_values(self.value_model, batch)[:, :-1]


# --------------------------------------------------------------------------------------------------
# Micro-batches for the update
# --------------------------------------------------------------------------------------------------


def trim_padding(rollout: Rollout) -> Rollout:
    """Drop the columns that are padding in every row: leading query columns (left padding) and response
    columns past the longest response. Positions count real tokens, so no real token moves."""
    first = int(rollout.query_mask.any(dim=0).long().argmax())  # first query column holding a real token
    length = int(rollout.response_mask.sum(1).max().clamp(min=1))
    if first == 0 and length == rollout.response_ids.shape[1]:
        return rollout
    queries = {name: getattr(rollout, name)[:, first:] for name in ("query_ids", "query_mask")}
    responses = {
        name: getattr(rollout, name)[:, :length] for name in ("response_ids", "response_mask", "logp_old")
    }
    estimates = {k: v[:, :length] if v.dim() == 2 else v for k, v in rollout.estimates().items()}
    return dataclasses.replace(rollout, **queries, **responses, **estimates)


def token_budget_groups(max_tokens: int, *part_lengths: torch.Tensor) -> list[list[int]]:
    """Rows grouped so that each group's padded size, rows x the sum over parts (query, response) of the
    part's longest, is at most ``max_tokens``: longest rows first, a row over the budget alone, short rows
    together. ``part_lengths`` are (B,) lengths, one tensor per separately padded part."""
    lengths = torch.stack([part.cpu().long() for part in part_lengths])  # (parts, B)
    groups: list[list[int]] = [[]]
    for row in torch.argsort(lengths.sum(0), descending=True, stable=True).tolist():
        grown = [*groups[-1], row]
        if groups[-1] and len(grown) * int(lengths[:, grown].max(1).values.sum()) > max_tokens:
            groups.append([row])
        else:
            groups[-1] = grown
    return groups


def token_budget_micro_batches(minibatch: Rollout, max_tokens: int) -> Iterator[Rollout]:
    """Trimmed micro-batches of at most ``max_tokens`` positions each, padding included (so at most that
    many real tokens), grouped by :func:`token_budget_groups`.

    The update's activations grow with the positions a forward computes, not with its rows, so a token
    budget bounds memory where a row count cannot: 4 rows of 1,000 tokens cost what 40 rows of 100 do.
    """
    for group in _budget_groups(minibatch, max_tokens):
        yield trim_padding(minibatch.select(torch.tensor(group)))


def _budget_groups(rollout: Rollout, max_tokens: int) -> list[list[int]]:
    return token_budget_groups(
        max_tokens, rollout.query_mask.sum(1), rollout.response_mask.sum(1).clamp(min=1)
    )


def balanced_assignment(row_tokens: Sequence[int], world_size: int) -> list[list[int]]:
    """Rows split over ``world_size`` ranks so that each gets a similar number of tokens: longest row
    first, each to the least loaded rank (ties to the lower rank). Every rank gets at least one row."""
    loads, assignment = [0] * world_size, [[] for _ in range(world_size)]
    order = sorted(range(len(row_tokens)), key=lambda i: (-row_tokens[i], i))
    for i, row in enumerate(order):
        rank = i if i < world_size else min(range(world_size), key=lambda r: (loads[r], r))
        assignment[rank].append(row)
        loads[rank] += row_tokens[row]
    return [sorted(rows) for rows in assignment]


def concat_rollouts(parts: Sequence[Rollout]) -> Rollout:
    """One rollout of every part's rows: queries left-padded and responses right-padded to the widest
    (padding is masked out, and a later :func:`trim_padding` drops it again)."""
    queries = max(part.query_ids.shape[1] for part in parts)
    responses = max(part.response_ids.shape[1] for part in parts)

    def left(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (queries - t.shape[1], 0))

    def right(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, responses - t.shape[1])) if t.dim() == 2 else t

    first = parts[0]
    return dataclasses.replace(
        first,
        query_ids=torch.cat([left(p.query_ids) for p in parts]),
        query_mask=torch.cat([left(p.query_mask) for p in parts]),
        **{
            name: torch.cat([right(getattr(p, name)) for p in parts])
            for name in ("response_ids", "response_mask", "terminated", "logp_old")
        },
        prompts=[prompt for p in parts for prompt in p.prompts],
        response_texts=[text for p in parts for text in p.response_texts],
        **{name: torch.cat([right(getattr(p, name)) for p in parts]) for name in first.estimates()},
    )


def stored_pass_batches(
    rollout: Rollout, rows: int | None = None, tokens: int | None = None
) -> Iterator[tuple[torch.Tensor, Rollout]]:
    """``(row indices, batch)`` covering every row once, for a pass without gradients: consecutive
    batches of ``rows`` (all rows by default), or trimmed batches within a ``tokens`` budget."""
    if tokens:
        for group in _budget_groups(rollout, tokens):
            index = torch.tensor(group)
            yield index, trim_padding(rollout.select(index))
        return
    for start in range(0, len(rollout), rows or len(rollout)):
        index = torch.arange(start, min(start + (rows or len(rollout)), len(rollout)))
        yield index, rollout.select(index)


def scatter_rows(pieces: list[tuple[torch.Tensor, torch.Tensor]], batch: int, width: int) -> torch.Tensor:
    """(B, width) from ``(row indices, (b, w <= width))`` pieces; columns a trimmed piece lacks are 0."""
    first = pieces[0][1]
    out = first.new_zeros((batch, width))
    for index, piece in pieces:
        out[index.to(out.device), : piece.shape[1]] = piece
    return out


def length_sorted_micro_batches(minibatch: Rollout, size: int) -> Iterator[Rollout]:
    """Micro-batches of ``size`` rows, trimmed; with several, rows of similar length go together.

    Length is real query plus counted response tokens. Gradient accumulation sums token-weighted
    micro-batch losses, so grouping rows by length changes no result, only how many padded positions
    the forward passes compute.
    """
    order = torch.arange(len(minibatch))
    if size < len(minibatch):
        lengths = minibatch.query_mask.sum(1) + minibatch.response_mask.sum(1)
        order = torch.argsort(lengths.cpu(), descending=True, stable=True)
    for start in range(0, len(minibatch), size):
        yield trim_padding(minibatch.select(order[start : start + size]))


def rank_micro_batches(
    minibatch: Rollout,
    *,
    micro_batch_size: int | None,
    micro_batch_tokens: int | None,
    world_size: int = 1,
    rank: int = 0,
    group=None,
    same_count: bool = False,
) -> tuple[list[Rollout], list[float]]:
    """This rank's micro-batches of ``minibatch`` (its share of rows) and their loss weights (1, or 0
    for padding): ``micro_batch_size`` global rows each, or forwards of at most ``micro_batch_tokens``.

    ``same_count`` (FSDP2, where each forward and backward is a collective): every rank runs as many as
    the rank with the most; the others repeat one row whose loss counts 0 (only a token budget can differ).
    """
    if micro_batch_tokens:  # a budget per forward, after evening out the ranks' token counts
        minibatch = balanced_over_ranks(minibatch, world_size, rank, group)
        micro_batches = list(token_budget_micro_batches(minibatch, micro_batch_tokens))
    else:
        micro_size = micro_batch_size // world_size if micro_batch_size else len(minibatch)
        micro_batches = list(length_sorted_micro_batches(minibatch, max(micro_size, 1)))
    weights = [1.0] * len(micro_batches)
    if same_count and micro_batch_tokens:  # row counts give every rank the same number already
        missing = max(gather_objects(len(micro_batches), group)) - len(micro_batches)
        micro_batches += [micro_batches[-1].select(torch.tensor([0]))] * missing
        weights += [0.0] * missing
    return micro_batches, weights


def balanced_over_ranks(minibatch: Rollout, world_size: int, rank: int, group) -> Rollout:
    """This rank's share of all ranks' minibatch rows, split so that every rank forwards a similar
    number of tokens (the slowest rank sets the pace of each synchronised backward). The loss is a
    global token mean, so which rank computes a row changes no result."""
    if group is None:
        return minibatch
    every = concat_rollouts(
        [part.to(minibatch.response_ids.device) for part in gather_objects(minibatch.to("cpu"), group)]
    )
    row_tokens = (every.query_mask.sum(1) + every.response_mask.sum(1)).long().tolist()
    mine = balanced_assignment(row_tokens, world_size)[rank]
    return every.select(torch.tensor(mine))


# --------------------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------------------


def sample_seed(seed: int, sample_id: int) -> int:
    """The sampling seed of one response (or of a batch, from its first): the run's seed and the sample's
    place in the prompt stream, so a sample draws the same tokens on any number of ranks and before and
    after a resume."""
    return (seed << 32) + sample_id


class Generator(Protocol):
    """Anything that turns prompts into a :class:`Rollout`: :class:`HFGenerator`, or
    :class:`lmppo.vllm_engine.VLLMGenerator`. An engine that samples from its own copy of the weights also
    has ``sync_weights(policy, policy_version)``, which the trainer calls after every policy update.
    ``sample_ids`` place each prompt in the prompt stream; a seeded engine draws from them."""

    def generate(
        self, prompts: Sequence[Prompt], policy_version: int, sample_ids: Sequence[int] | None = None
    ) -> Rollout: ...


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


def prompt_room(context: int | None, max_new_tokens: int, max_prompt_length: int | None) -> int | None:
    """Tokens a rendered prompt may take in a ``context``-token window (None: no limit known) next to
    ``max_new_tokens`` of response: ``data.max_prompt_length`` when set, else the rest of the window."""
    if context is not None and max_new_tokens >= context:
        raise LmppoError(
            f"rollout.max_new_tokens={max_new_tokens} leaves no room for a prompt in the policy's {context}-token "
            f"context window (max_position_embeddings); set rollout.max_new_tokens below {context}"
        )
    room = None if context is None else context - max_new_tokens
    if max_prompt_length is None:
        return room
    if room is not None and max_prompt_length > room:
        raise LmppoError(
            f"data.max_prompt_length={max_prompt_length} + rollout.max_new_tokens={max_new_tokens} exceeds the "
            f"policy's {context}-token context window; lower one of them"
        )
    return max_prompt_length


class HFGenerator:
    """Samples responses from a transformers causal LM, one decode step per token on a static KV cache.

    Prompts are rendered with the tokenizer's own chat template (or ``chat_template``) and
    ``add_generation_prompt=True``; ``raw_prompts=True`` tokenises prompt strings as they are. Only
    temperature, top-k and top-p shape the sampling distribution (the checkpoint's ``generation_config``
    is never read: no repetition penalty, min length, suppressed tokens, ...). Generation stops at the
    tokenizer's EOS and ``stop_token_ids``, or after ``max_new_tokens``.

    The loop is ours rather than ``model.generate``: the cache is a ``StaticCache`` sized for the prompt
    plus ``max_new_tokens`` (a ``DynamicCache`` concatenates every layer's keys and values at every
    step, a cost quadratic in the response length), there is no per-step machinery beyond the forward
    and the draw, and ``logp_old`` comes from the logits the token is drawn from. LoRA adapters are folded
    into a temporary copy of their base weights for the loop (:func:`~lmppo.lora.lora_merged`). The draw is
    transformers' own (tempered scores, top-k, top-p, ``torch.multinomial``), so a seed gives the same
    tokens as ``model.generate`` would.

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
        width = max(len(ids) for ids in rows)
        query_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        query_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, ids in enumerate(rows):
            query_ids[i, width - len(ids) :] = torch.tensor(ids)
            query_mask[i, width - len(ids) :] = 1
        return query_ids, query_mask

    def generate(
        self, prompts: Sequence[Prompt], policy_version: int, sample_ids: Sequence[int] | None = None
    ) -> Rollout:
        """Sample one response per prompt; ``logp_old`` is recorded while sampling."""
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
            policy_version=policy_version,
            created_at=time.time(),
            prompts=list(prompts),
            response_texts=self._decode(response_ids, response_mask, terminated),
            temperature=self.temperature,
            **estimates,
        )

    def _sample(
        self, query_ids: torch.Tensor, query_mask: torch.Tensor, sample_ids: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The decode loop on ``self.model`` in eval mode, its LoRA adapters folded for the loop. An engine
        that overrides this never touches the trained module: with ``rollout.asynchronous`` it samples while
        the update trains that module on another thread."""
        with eval_mode(self.model), lora_merged(self.model):
            return self._decode_loop(query_ids, query_mask, sample_ids)

    def _decode_loop(
        self, query_ids: torch.Tensor, query_mask: torch.Tensor, sample_ids: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Ancestral sampling: a prefill over the queries, then one single-token forward per step.

        Returns ``response_ids`` (B, R') and their log-probs (B, R') at the sampling temperature, with
        R' <= max_new_tokens (the loop ends once every row has emitted a stop token; a finished row is
        filled with the pad id), and with a value model the values (B, R' + 1) of the state before each
        token and after the last one (a truncated row needs one more forward for it, run only with
        ``bootstrap_values``; a column no forward reached is 0). Positions count real tokens only, as in :func:`sequence_inputs`.
        """
        batch, width = query_ids.shape
        device = query_ids.device
        rng = None  # the global RNG, unless seeded
        if self.seed is not None:
            rng = torch.Generator(device).manual_seed(sample_seed(self.seed, sample_ids[0]))
        cache = {
            _cache_argument(self.model): static_cache(
                unwrap_model(self.model).config, max_cache_len=width + self.max_new_tokens
            )
        }
        attention_mask = torch.zeros(batch, width + self.max_new_tokens, dtype=torch.long, device=device)
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
        for step in range(self.max_new_tokens):
            advance("token", step + 1, self.max_new_tokens)
            token, logp = self._draw(logits, rng)
            token = token.masked_fill(finished, self.pad_token_id)
            tokens.append(token)
            logps.append(logp)
            finished |= torch.isin(token, stops)
            last = step + 1 == self.max_new_tokens or finished.all()
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
