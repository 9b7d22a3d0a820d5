"""The rollout record: the response mask (also when pad == EOS), selection, concatenation, token budgets
and each rank's balanced share."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rollout_samples import PROMPTS, generate

from lmppo.sampling.rollout import (
    EstimatedRollout,
    balanced_assignment,
    concat_rollouts,
    response_mask_from_ids,
    token_budget_groups,
    trim_padding,
)

EOS, PAD, END = 2, 0, 9


@pytest.mark.parametrize(
    "ids, stops, mask, terminated",
    [
        (
            [[5, 6, EOS, PAD, PAD], [5, EOS, PAD, PAD, PAD]],
            [EOS],
            [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]],
            [1, 1],
        ),  # ragged
        ([[EOS, PAD, PAD]], [EOS], [[1, 0, 0]], [1]),  # stops at its first token
        ([[5, 6, 7]], [EOS], [[1, 1, 1]], [0]),  # no stop: truncated, every token counts
        ([[5, EOS, EOS, EOS]], [EOS], [[1, 1, 0, 0]], [1]),  # pad == EOS: only the first EOS counts
        ([[EOS, EOS, EOS]], [EOS], [[1, 0, 0]], [1]),  # pad == EOS, stop at the first token
        ([[5, END, 6, EOS]], [EOS, END], [[1, 1, 0, 0]], [1]),  # extra stop id ends the response
        ([[5, EOS, 6, 7]], [EOS], [[1, 1, 0, 0]], [1]),  # real-looking tokens after the stop are not counted
        ([[5, PAD, 6]], [EOS], [[1, 1, 1]], [0]),  # a sampled pad id (pad != EOS) is a real token
    ],
)
def test_response_mask_rules(ids, stops, mask, terminated):
    got_mask, got_terminated = response_mask_from_ids(torch.tensor(ids), stops)
    assert got_mask.dtype == torch.float32
    assert got_mask.tolist() == mask
    assert got_terminated.tolist() == [bool(t) for t in terminated]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=9), min_size=1, max_size=5).filter(
        lambda rows: len({len(r) for r in rows}) == 1
    )
)
def test_response_mask_is_the_prefix_through_the_first_stop(rows):
    ids = torch.tensor(rows)
    mask, terminated = response_mask_from_ids(ids, [2, 5])
    for row, row_mask, row_terminated in zip(rows, mask.tolist(), terminated.tolist()):
        first_stop = next((t for t, tok in enumerate(row) if tok in (2, 5)), None)
        counted = len(row) if first_stop is None else first_stop + 1
        assert row_mask == [1.0] * counted + [0.0] * (len(row) - counted)
        assert row_terminated == (first_stop is not None)


def test_balanced_assignment_evens_out_the_ranks_tokens():
    tokens = [90, 10, 10, 10, 40, 40, 10, 30]
    two = balanced_assignment(tokens, 2)
    assert sorted(r for rows in two for r in rows) == list(range(8))
    loads = [sum(tokens[r] for r in rows) for rows in two]
    assert max(loads) - min(loads) <= max(tokens) and loads == [120, 120]
    assert all(balanced_assignment([5, 1], 2))  # every rank gets a row


def test_concat_rollouts_pads_each_part_and_keeps_every_real_token(policy_tokenizer, policy_model):
    rollout = generate(policy_model, policy_tokenizer, prompts=PROMPTS * 2, max_new_tokens=8, seed=1)
    rollout = dataclasses.replace(rollout, values=torch.randn(rollout.response_ids.shape))
    parts = [trim_padding(rollout.select(slice(0, 3))), trim_padding(rollout.select(slice(3, None)))]
    whole = concat_rollouts(parts)
    assert whole.prompts == rollout.prompts and whole.response_texts == rollout.response_texts
    mask = rollout.response_mask.bool()
    for name in ("response_ids", "logp_old"):
        assert torch.equal(getattr(whole, name)[mask], getattr(rollout, name)[mask])
    assert torch.equal(whole.values[mask], rollout.values[mask])
    real = rollout.query_mask.bool()
    width = whole.query_ids.shape[1]
    assert torch.equal(
        whole.query_ids[whole.query_mask.bool()], rollout.query_ids[:, -width:][real[:, -width:]]
    )
    assert torch.equal(whole.query_mask.sum(1), rollout.query_mask.sum(1))


def test_token_budget_groups_respect_the_budget_and_cover_every_row():
    queries, responses = torch.tensor([5, 3, 9, 2, 4]), torch.tensor([1, 7, 2, 2, 6])
    groups = token_budget_groups(20, queries, responses)
    assert sorted(i for g in groups for i in g) == [0, 1, 2, 3, 4]
    for group in groups:  # padded size: rows x (longest query + longest response)
        assert len(group) == 1 or len(group) * (queries[group].max() + responses[group].max()) <= 20
    assert token_budget_groups(1, queries, responses) == [
        [2],
        [1],
        [4],
        [0],
        [3],
    ]  # each alone, longest first


def test_select_minibatches_and_to(policy_tokenizer, policy_model):
    sampled = generate(policy_model, policy_tokenizer, prompts=PROMPTS * 2)
    rows = torch.arange(len(sampled), dtype=torch.float32)
    rollout = EstimatedRollout.after(  # the last stage's record: every stage's fields follow the rows
        sampled,
        rm_score=rows,
        logp_ref=sampled.logp_old,
        kl_ref=torch.zeros_like(sampled.logp_old),
        advantages=rows[:, None].expand(-1, 3),
        returns=rows[:, None].expand(-1, 3),
    )
    picked = rollout.select([5, 1])
    assert type(picked) is EstimatedRollout
    assert len(picked) == 2 and picked.prompts == [rollout.prompts[5], rollout.prompts[1]]
    assert torch.equal(picked.logp_old, rollout.logp_old[[5, 1]])
    assert picked.advantages[:, 0].tolist() == [5.0, 1.0] and picked.rm_score.tolist() == [5.0, 1.0]
    assert picked.response_texts == [rollout.response_texts[5], rollout.response_texts[1]]
    batches = list(rollout.minibatches(3, shuffle_generator=torch.Generator().manual_seed(0)))
    assert [len(mb) for mb in batches] == [3, 3, 2]
    seen = torch.cat([mb.advantages[:, 0] for mb in batches])
    assert sorted(seen.tolist()) == list(map(float, range(len(rollout))))
    assert seen.tolist() != sorted(seen.tolist())  # shuffled
    for mb in batches:  # rows stay aligned across fields
        rows = mb.advantages[:, 0].long()
        assert torch.equal(mb.response_ids, rollout.response_ids[rows])
    moved = rollout.to("meta")
    assert moved.logp_old.is_meta and moved.query_mask.is_meta and moved.advantages.is_meta
    assert rollout.num_response_tokens == int(rollout.response_lengths.sum())
