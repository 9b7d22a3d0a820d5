"""The rollout record and its batching.

Layout (see docs/rollout.md): queries are left-padded ``(B, Q)``; per-token tensors are ``(B, R)`` over
response positions. ``logp_old[:, t] = log pi(response[t] | query, response[:t])`` at the sampling
temperature; ``values[:, t]`` is V of the state before response token ``t``; ``response_mask`` is 1 on
generated tokens up to and including the first stop token. An environment's episode (docs/multiturn.md)
holds several turns in the response, the context between them marked by ``context_mask``; the policy's own
tokens are the ``action_mask``.

Every forward over a (query, response) batch takes its inputs from :func:`sequence_inputs`: the attention
mask comes from the tokenizer (never from ``ids != pad``, which hides a real EOS when pad == EOS) and
``position_ids`` are explicit (left padding without them shifts positions).

This module owns the :class:`Rollout` and how it is cut: rows selected, shuffled minibatches, trimmed
micro-batches by rows or by a token budget, each rank's balanced share, batches for a pass without
gradients. The passes over it are :mod:`lmppo.sampling.passes`; the engines that sample it are behind
:class:`lmppo.sampling.engines.Generator`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Self

import torch

from lmppo.modeling.distributed import gather_objects

# --------------------------------------------------------------------------------------------------
# One record per stage: sampled, scored, estimated
# --------------------------------------------------------------------------------------------------

QUERY_COLUMNS = ("query_ids", "query_mask")  # (B, Q), left-padded; every other 2-D tensor is (B, R)


class RowRecord:
    """A record of B rows (a dataclass): every tensor (B, ...), list of B, dictionary of such tensors and
    nested record is per row, and follows the row operations."""

    def per_row(self) -> dict[str, torch.Tensor | list | dict | RowRecord]:
        """The fields that hold one entry per row, by name; None ones left out."""
        return {
            f.name: value
            for f in dataclasses.fields(self)
            if isinstance(value := getattr(self, f.name), torch.Tensor | list | dict | RowRecord)
        }

    def map_rows(self, change: Callable[[str, torch.Tensor | list], torch.Tensor | list]) -> Self:
        """This record with ``change(name, value)`` of every per-row tensor and list, nested ones included
        (a dictionary's under its keys)."""

        def changed(name: str, value):
            if isinstance(value, RowRecord):
                return value.map_rows(change)
            if isinstance(value, dict):
                return {key: change(key, v) for key, v in value.items()}
            return change(name, value)

        return dataclasses.replace(self, **{n: changed(n, v) for n, v in self.per_row().items()})

    def select(self, index) -> Self:
        """The rows ``index`` (ints, slice, bool mask or index tensor) as a new record of the same kind."""
        if isinstance(index, torch.Tensor):
            index = index.cpu()
        rows = torch.arange(len(self))[index].reshape(-1)

        def picked(name: str, value):
            return (
                [value[i] for i in rows.tolist()] if isinstance(value, list) else value[rows.to(value.device)]
            )

        return self.map_rows(picked)

    def to(self, device: torch.device | str) -> Self:
        return self.map_rows(lambda name, v: v.to(device) if isinstance(v, torch.Tensor) else v)


def joined_rows(parts: Sequence[RowRecord], join: Callable[[str, list], torch.Tensor | list]) -> RowRecord:
    """One record of all ``parts`` (records of one kind): ``join(name, values)`` of each per-row field's
    values, one per part (nested records and dictionaries joined field by field)."""

    def joined(name: str, values: list):
        if isinstance(values[0], RowRecord):
            return joined_rows(values, join)
        if isinstance(values[0], dict):
            return {key: join(key, [v[key] for v in values]) for key in values[0]}
        return join(name, values)

    first = parts[0]
    return dataclasses.replace(
        first, **{n: joined(n, [getattr(p, n) for p in parts]) for n in first.per_row()}
    )


@dataclass(frozen=True)
class EpisodePart(RowRecord):
    """What an environment's episodes add to a rollout (docs/multiturn.md): which response tokens are
    context, each turn's reward, the transcripts, and per episode whatever the environment reports
    (:attr:`counts`, logged as ``episode/<name>``)."""

    context_mask: torch.Tensor  # (B, R) 1 on tokens its turns inserted (tool output, template)
    turn_rewards: torch.Tensor  # (B, R) each turn's reward from it, on the turn's last action
    transcripts: list  # per episode: its text in runs of (text, is_action), for reading
    counts: dict[str, torch.Tensor]  # (B,) per name: the policy's turns, the tool calls, the failed ones, ...
    environment_s: float = 0.0  # seconds the environments took to reset and step

    def __len__(self) -> int:
        return self.context_mask.shape[0]


@dataclass(frozen=True)
class Rollout(RowRecord):
    """What the engine sampled: one batch of responses with everything PPO needs from the sampling policy.

    Tensors: ``query_ids`` (B, Q) long, left-padded; ``query_mask`` (B, Q) long, 1 = real prompt token;
    ``response_ids`` (B, R) long; ``response_mask`` (B, R) float, 1 on the tokens of the response up to and
    including the first stop token; ``terminated`` (B,) bool (emitted a stop token; else truncated at
    ``max_new_tokens``); ``logp_old`` (B, R) float32 at ``temperature``, as the sampler recorded them. A
    decode loop that reads a shared critic's values as it samples also gives ``values`` (B, R) and
    ``bootstrap_value`` (B,).

    Each stage returns a new record: :class:`ScoredRollout` adds what scoring made, :class:`EstimatedRollout`
    the advantages. Every tensor (B, ...), every list of B and the episode part's follow :meth:`select`,
    :meth:`minibatches`, :meth:`to`, :func:`trim_padding` and :func:`concat_rollouts`, whatever the stage
    (:class:`RowRecord`).
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
    episode: EpisodePart | None = None  # an environment's episodes (rollout.environment); None: one response
    reward_raw: list | None = None  # per row, each reward component's raw score, when sampling scored it

    def __len__(self) -> int:
        return self.query_ids.shape[0]

    @classmethod
    def after(cls, previous: Rollout, **added) -> Self:
        """This stage's record: every field of the ``previous`` stage's record, and what this stage added
        (which may replace one, as a values pass does the decode loop's)."""
        fields = {f.name: getattr(previous, f.name) for f in dataclasses.fields(previous)}
        return cls(**(fields | added))

    @property
    def action_mask(self) -> torch.Tensor:
        """(B, R): the tokens the policy sampled (each turn's stop token included), the only ones in the loss,
        the KL and GAE's credit path. Without an environment every response token is one; in an episode the
        context an environment's turns inserted is in the sequence (``response_mask``) but not an action."""
        if self.episode is None:
            return self.response_mask
        return self.response_mask * (1.0 - self.episode.context_mask)

    @property
    def response_lengths(self) -> torch.Tensor:
        """(B,) long: counted response tokens per row (stop token included); in an episode, the policy's
        own tokens over all its turns."""
        return self.action_mask.sum(dim=1).long()

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_mask.sum())

    def sequence_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(input_ids, attention_mask, position_ids)``, each (B, Q + R), for a forward pass."""
        return sequence_inputs(self.query_ids, self.query_mask, self.response_ids)

    def minibatches(self, size: int, shuffle_generator: torch.Generator | None = None) -> Iterator[Rollout]:
        """Consecutive minibatches of ``size`` rows (the last may be smaller), shuffled when given a generator."""
        if shuffle_generator is None:
            order = torch.arange(len(self))
        else:
            order = torch.randperm(len(self), generator=shuffle_generator)
        for start in range(0, len(self), size):
            yield self.select(order[start : start + size])


@dataclass(frozen=True, kw_only=True)
class ScoredRollout(Rollout):
    """What scoring added: the score each row's reward uses, the reference's log-probs and the per-token KL
    to it (the estimator's rewards and the metrics read it, never computing it again) and, with a critic,
    the values (a stored pass, unless the decode loop read them already)."""

    rm_score: torch.Tensor  # (B,) preprocessed; 0 on unfinished rows when they are bootstrapped instead
    logp_ref: torch.Tensor  # (B, R) the frozen reference's log-probs of the samples, at the temperature
    kl_ref: torch.Tensor  # (B, R) KL(old policy || reference) per action token (kl.estimator), 0 elsewhere
    logp_trainer: torch.Tensor | None = None  # ppo.tis_cap: the trainer's own log-probs of the samples
    tis_weights: torch.Tensor | None = None  # ppo.tis_cap: min(p_trainer / p_sampler, cap) per token

    @property
    def logp_old_for_update(self) -> torch.Tensor:
        """The old policy's log-probs that the KL reward and the PPO ratio use: the trainer's own under
        ``ppo.tis_cap`` (the sampler's then only weight the tokens), else the sampler's."""
        return self.logp_trainer if self.logp_trainer is not None else self.logp_old

    @property
    def episode_score(self) -> torch.Tensor:
        """(B,) what judges a row as a whole (a group estimator's baseline, best-of-n's pick): the run's
        reward, plus an episode's turn rewards."""
        return self.rm_score if self.episode is None else self.rm_score + self.episode.turn_rewards.sum(1)


@dataclass(frozen=True, kw_only=True)
class EstimatedRollout(ScoredRollout):
    """What the estimator produced: the update's targets."""

    advantages: torch.Tensor  # (B, R), whitened when the estimator whitens
    returns: torch.Tensor  # (B, R), the critic's targets (the advantages themselves without a critic)


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
# Batches and micro-batches
# --------------------------------------------------------------------------------------------------


def trim_padding(rollout: Rollout) -> Rollout:
    """Drop the columns that are padding in every row: leading query columns (left padding) and response
    columns past the longest response. Positions count real tokens, so no real token moves."""
    first = int(rollout.query_mask.any(dim=0).long().argmax())  # first query column holding a real token
    length = int(rollout.response_mask.sum(1).max().clamp(min=1))
    if first == 0 and length == rollout.response_ids.shape[1]:
        return rollout

    def trimmed(name: str, value):
        if not isinstance(value, torch.Tensor) or value.dim() != 2:
            return value
        return value[:, first:] if name in QUERY_COLUMNS else value[:, :length]

    return rollout.map_rows(trimmed)


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
    """One record of every part's rows (all of one stage): queries left-padded and responses right-padded to
    the widest (padding is masked out, and a later :func:`trim_padding` drops it again)."""
    queries = max(part.query_ids.shape[1] for part in parts)
    responses = max(part.response_ids.shape[1] for part in parts)

    def padded(name: str, t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 1:
            return t
        if name in QUERY_COLUMNS:
            return torch.nn.functional.pad(t, (queries - t.shape[1], 0))
        return torch.nn.functional.pad(t, (0, responses - t.shape[1]))

    def join(name: str, values: list):
        if isinstance(values[0], list):
            return [item for v in values for item in v]
        return torch.cat([padded(name, v) for v in values])

    return joined_rows(parts, join)


def padded_tokens(batch: Rollout) -> int:
    """The positions one forward over ``batch`` computes: rows x (query + response columns)."""
    return len(batch) * (batch.query_ids.shape[1] + batch.response_ids.shape[1])


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
