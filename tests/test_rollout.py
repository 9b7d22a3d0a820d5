"""Rollout: masks, sampling log-probs, stored passes, and the pitfalls that bit TRL / OpenRLHF / veRL."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import GPT2Config, GPT2LMHeadModel

from lmppo.core import last_response_index, shaped_rewards, token_logprobs
from lmppo.errors import LmppoError, LmppoWarning
from lmppo.hf_engine import HFGenerator
from lmppo.lora import apply_lora
from lmppo.models import ValueModel, trainable_parameters
from lmppo.passes import (
    policy_logprobs_and_values,
    response_logits,
    response_logprobs,
    sequence_logprobs,
    value_predictions,
)
from lmppo.rollout import (
    Rollout,
    balanced_assignment,
    concat_rollouts,
    response_mask_from_ids,
    token_budget_groups,
    trim_padding,
)

LOGP_TOL = 1e-4  # fp32: KV-cached sampling vs one teacher-forced pass differ by ~1e-6
PROMPTS = [
    "tell me a short story about the cat",
    "good",
    [  # multi-turn: with pad == EOS the prompt itself holds pad-id tokens that must stay attended
        {"role": "user", "content": "write a poem"},
        {"role": "assistant", "content": "red sun"},
        {"role": "user", "content": "one more about the dog"},
    ],
    "sad day",
]


def stop_ids(tokenizer) -> list[int]:
    return [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|end|>")]


def generate(model, tokenizer, *, seed=0, prompts=PROMPTS, **kwargs) -> Rollout:
    kwargs.setdefault("max_new_tokens", 10)
    kwargs.setdefault("stop_token_ids", stop_ids(tokenizer))
    torch.manual_seed(seed)
    return HFGenerator(model, tokenizer, **kwargs).generate(prompts, policy_version=7)


def unpadded(rollout: Rollout, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row b's real prompt ids and its counted response ids, without any padding."""
    query = rollout.query_ids[b][rollout.query_mask[b].bool()]
    response = rollout.response_ids[b][rollout.response_mask[b].bool()]
    return query, response


def teacher_forced_logprobs(model, rollout: Rollout, b: int, temperature: float) -> torch.Tensor:
    """Independent check: one unpadded row, default positions, full logits, sliced by hand."""
    query, response = unpadded(rollout, b)
    with torch.no_grad():
        logits = model(input_ids=torch.cat([query, response])[None]).logits[0]
    predicting = logits[len(query) - 1 : len(query) + len(response) - 1] / temperature
    return torch.log_softmax(predicting, dim=-1).gather(1, response[:, None]).squeeze(1)


# --------------------------------------------------------------------------------------------------
# Response mask
# --------------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------------
# Generation and logp_old
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pad_is_eos", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logp_old_equals_teacher_forced_forward(
    make_policy_tokenizer, make_causal_lm, temperature, pad_is_eos
):
    tokenizer = make_policy_tokenizer(pad_is_eos=pad_is_eos)
    model = make_causal_lm(tokenizer)
    rollout = generate(model, tokenizer, temperature=temperature)
    assert rollout.temperature == temperature and rollout.policy_version == 7
    assert rollout.logp_old.dtype == torch.float32
    for b in range(len(rollout)):
        n = rollout.response_lengths[b]
        torch.testing.assert_close(
            rollout.logp_old[b, :n],
            teacher_forced_logprobs(model, rollout, b, temperature),
            atol=LOGP_TOL,
            rtol=0,
        )
    # the batched helper (left padding + explicit position_ids) agrees too
    with torch.no_grad():
        batched = token_logprobs(response_logits(model, rollout), rollout.response_ids)
    keep = rollout.response_mask.bool()
    torch.testing.assert_close(batched[keep], rollout.logp_old[keep], atol=LOGP_TOL, rtol=0)


def test_explicit_position_ids_with_left_padding(policy_tokenizer):
    """GPT-2 has absolute positions: a left-padded forward without position_ids shifts them (TRL #6800)."""
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(policy_tokenizer),
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = GPT2LMHeadModel(config).eval()
    rollout = generate(model, policy_tokenizer, temperature=0.7)
    keep = rollout.response_mask.bool()
    with torch.no_grad():
        batched = token_logprobs(response_logits(model, rollout), rollout.response_ids)
        input_ids, attention_mask, _ = rollout.sequence_inputs()
        queries = rollout.query_ids.shape[1]
        no_positions = (
            model(input_ids=input_ids, attention_mask=attention_mask).logits[:, queries - 1 : -1] / 0.7
        )
    torch.testing.assert_close(batched[keep], rollout.logp_old[keep], atol=LOGP_TOL, rtol=0)
    for b in range(len(rollout)):
        n = rollout.response_lengths[b]
        torch.testing.assert_close(
            rollout.logp_old[b, :n], teacher_forced_logprobs(model, rollout, b, 0.7), atol=LOGP_TOL, rtol=0
        )
    shifted = token_logprobs(no_positions, rollout.response_ids)
    assert (shifted[keep] - rollout.logp_old[keep]).abs().max() > 1e-2  # the pitfall is real for this model


def test_pad_equal_to_eos_keeps_real_eos_tokens_attended(make_policy_tokenizer, make_causal_lm):
    """With pad == EOS, a mask built as ``ids != pad`` would hide the prompt's turn-ending EOS tokens."""
    tokenizer = make_policy_tokenizer(pad_is_eos=True)
    rollout = generate(make_causal_lm(tokenizer), tokenizer, max_new_tokens=4)
    generator = HFGenerator(make_causal_lm(tokenizer), tokenizer, max_new_tokens=4)
    rendered = [generator.render(p) for p in PROMPTS]
    assert rollout.query_mask.sum(dim=1).tolist() == [len(ids) for ids in rendered]
    multi_turn = 2
    eos_in_prompt = (rollout.query_ids[multi_turn] == tokenizer.eos_token_id) & rollout.query_mask[
        multi_turn
    ].bool()
    assert eos_in_prompt.sum() == 3  # one per turn, all attended
    _input_ids, attention_mask, _ = rollout.sequence_inputs()
    assert attention_mask[:, rollout.query_ids.shape[1] :].all()  # a generated EOS is attended as well


def test_rows_stopping_at_first_token_and_score_on_the_stop_token(
    make_policy_tokenizer, make_causal_lm, boosted
):
    """The sequence score goes on the EOS token itself, not on the pad after it (TRL #3750)."""
    tokenizer = make_policy_tokenizer(pad_is_eos=True)
    model = boosted(make_causal_lm(tokenizer), tokenizer.eos_token_id, 2.5)
    rollout = generate(model, tokenizer, prompts=PROMPTS * 3, max_new_tokens=6, seed=3)
    assert rollout.terminated.any() and not rollout.terminated.all()
    assert (rollout.response_lengths == 1).any()  # some rows stop at their very first token
    last = last_response_index(rollout.response_mask)
    rows = torch.arange(len(rollout))
    stop_tokens = torch.tensor(stop_ids(tokenizer))
    assert torch.isin(rollout.response_ids[rows, last][rollout.terminated], stop_tokens).all()
    assert (last[~rollout.terminated] == rollout.response_ids.shape[1] - 1).all()
    rm_score = torch.arange(len(rollout), dtype=torch.float32) + 1
    zeros = torch.zeros_like(rollout.logp_old)
    rewards = shaped_rewards(rm_score, zeros, zeros, rollout.response_mask, beta=0.1)
    torch.testing.assert_close(rewards[rows, last], rm_score)
    assert rewards.sum() == rm_score.sum()  # nothing placed anywhere else (e.g. on a trailing pad)


def test_response_texts_stop_before_the_stop_token(policy_tokenizer, policy_model, boosted):
    model = boosted(policy_model, policy_tokenizer.convert_tokens_to_ids("<|end|>"), 2.5)
    rollout = generate(model, policy_tokenizer, prompts=PROMPTS * 2, seed=1)
    assert rollout.terminated.any()
    for b, text in enumerate(rollout.response_texts):
        _, counted = unpadded(rollout, b)
        content = counted[:-1] if rollout.terminated[b] else counted
        assert text == policy_tokenizer.decode(content, skip_special_tokens=True)


def test_dropout_does_not_change_stored_passes(make_policy_tokenizer, make_causal_lm):
    """Dropout during the stored passes makes logp_old irreproducible (ratio != 1 at the first epoch)."""
    tokenizer = make_policy_tokenizer()
    model = make_causal_lm(tokenizer, attention_dropout=0.5).train()
    rollout = generate(model, tokenizer)
    assert model.training  # restored after generation
    value_model = ValueModel.from_causal_lm(model).train()
    torch.nn.init.normal_(value_model.head.weight)
    with torch.no_grad():
        for b in range(len(rollout)):
            model.eval()
            expected = teacher_forced_logprobs(model, rollout, b, 1.0)
            model.train()
            torch.testing.assert_close(rollout.logp_old[b, : len(expected)], expected, atol=LOGP_TOL, rtol=0)
    first, second = sequence_logprobs(model, rollout), sequence_logprobs(model, rollout)
    assert torch.equal(first, second) and model.training
    assert torch.equal(value_predictions(value_model, rollout)[0], value_predictions(value_model, rollout)[0])
    assert value_model.training


def test_checkpoint_generation_config_never_overrides_ours(policy_tokenizer, policy_model, boosted):
    model = boosted(policy_model, policy_tokenizer.eos_token_id, 30.0)  # always stops at the first token
    own = model.generation_config
    own.update(
        repetition_penalty=10.0,
        min_new_tokens=5,
        suppress_tokens=[policy_tokenizer.eos_token_id],
        top_k=1,
        temperature=0.01,
        do_sample=False,
        no_repeat_ngram_size=1,
    )
    rollout = generate(model, policy_tokenizer, max_new_tokens=8)
    assert rollout.response_lengths.tolist() == [1] * len(PROMPTS)  # min_new_tokens / suppress_tokens ignored
    assert rollout.terminated.all()
    for b in range(len(rollout)):  # the recorded logits were not penalised
        torch.testing.assert_close(
            rollout.logp_old[b, :1], teacher_forced_logprobs(model, rollout, b, 1.0), atol=LOGP_TOL, rtol=0
        )
    assert model.generation_config is own and own.repetition_penalty == 10.0  # the model's config is back


def test_top_k_warns_and_stores_untruncated_tempered_logprobs(policy_tokenizer, policy_model):
    with pytest.warns(LmppoWarning, match="off-policy"):  # shown as one plain `warning:` line
        rollout = generate(policy_model, policy_tokenizer, temperature=0.8, top_k=3, max_new_tokens=12)
    with torch.no_grad():
        logits = response_logits(policy_model, rollout)  # tempered by the rollout's temperature
    keep = rollout.response_mask.bool()
    torch.testing.assert_close(
        token_logprobs(logits, rollout.response_ids)[keep], rollout.logp_old[keep], atol=LOGP_TOL, rtol=0
    )
    rank = (logits > logits.gather(2, rollout.response_ids[..., None])).sum(
        -1
    )  # tokens scored above the sample
    assert (rank[keep] < 3).all()  # sampling was truncated to the top 3
    assert (rollout.logp_old[keep] < 0).all()  # but the stored log-probs are not renormalised over them


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (3, 1.0), (0, 0.8)])
def test_draws_follow_the_tempered_truncated_distribution(policy_tokenizer, policy_model, top_k, top_p):
    """The sampler: frequencies match softmax(logits / T) over the kept tokens, never a dropped one."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the off-policy warning for top-k / top-p
        generator = HFGenerator(
            policy_model, policy_tokenizer, max_new_tokens=1, temperature=0.5, top_k=top_k, top_p=top_p
        )
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 0.2, -3.0])
    draws = 40_000
    torch.manual_seed(0)
    tokens, logp = generator._draw(row.repeat(draws, 1))
    expected = torch.softmax(row / 0.5, dim=0)
    keep = torch.ones_like(row, dtype=torch.bool)
    if top_k:
        keep = row >= row.topk(top_k).values[-1]
    if top_p < 1.0:  # the most likely tokens until their mass reaches top_p
        probs, order = expected.sort(descending=True)
        keep = torch.zeros_like(keep).scatter(0, order, probs.cumsum(0) - probs < top_p)
    expected = torch.where(keep, expected, 0.0) / expected[keep].sum()
    frequencies = torch.bincount(tokens, minlength=len(row)).double() / draws
    torch.testing.assert_close(frequencies, expected.double(), atol=0.01, rtol=0)
    assert (frequencies[~keep] == 0).all()
    torch.testing.assert_close(logp, torch.log_softmax(row / 0.5, dim=0)[tokens])  # untruncated, tempered


def test_no_warning_without_truncation(policy_tokenizer, policy_model, recwarn):
    generate(policy_model, policy_tokenizer)
    assert not [w for w in recwarn if "off-policy" in str(w.message)]


# --------------------------------------------------------------------------------------------------
# Stored passes: reference, values, shared trunk
# --------------------------------------------------------------------------------------------------


def test_values_are_read_before_each_token_and_bootstrap_after_the_last(
    policy_tokenizer, policy_model, boosted
):
    """values[:, t] = V(query + response[:t]); off by one is the classic critic bug (veRL #1758)."""
    model = boosted(policy_model, policy_tokenizer.eos_token_id, 1.5)
    rollout = generate(model, policy_tokenizer, prompts=PROMPTS * 2, max_new_tokens=8, seed=2)
    assert rollout.terminated.any() and not rollout.terminated.all()
    value_model = ValueModel.from_causal_lm(model)
    torch.nn.init.normal_(value_model.head.weight)
    values, bootstrap = value_predictions(value_model, rollout, forward_batch_size=3)
    assert values.shape == rollout.response_ids.shape and bootstrap.shape == (len(rollout),)
    with torch.no_grad():
        for b in range(len(rollout)):
            query, response = unpadded(rollout, b)
            sequence = torch.cat([query, response])[None]
            positions = torch.arange(sequence.shape[1])[None]
            v = value_model(sequence, torch.ones_like(sequence), positions)[0]
            for t in range(len(response)):  # state before token t: its last token is at len(query) + t - 1
                torch.testing.assert_close(values[b, t], v[len(query) + t - 1], atol=1e-5, rtol=0)
            expected_bootstrap = torch.tensor(0.0) if rollout.terminated[b] else v[-1]
            torch.testing.assert_close(bootstrap[b], expected_bootstrap, atol=1e-5, rtol=0)


@pytest.mark.parametrize("boost", [1.5, 8.0])  # some rows truncated (one more forward) / every row stops
def test_a_shared_trunk_reads_its_values_off_the_decode_loop(policy_tokenizer, policy_model, boosted, boost):
    """The same values and bootstrap as the values pass, the same tokens and log-probs as without them."""
    model = boosted(policy_model, policy_tokenizer.eos_token_id, boost)
    value_model = ValueModel.shared_trunk(model)
    torch.nn.init.normal_(value_model.head.weight)
    plain = generate(model, policy_tokenizer, prompts=PROMPTS * 2, max_new_tokens=8, seed=2)
    rollout = generate(
        model, policy_tokenizer, prompts=PROMPTS * 2, max_new_tokens=8, seed=2, value_model=value_model
    )
    assert rollout.terminated.all() == (boost == 8.0) and rollout.terminated.any()
    assert torch.equal(rollout.response_ids, plain.response_ids) and torch.equal(
        rollout.logp_old, plain.logp_old
    )
    assert plain.values is None
    values, bootstrap = value_predictions(value_model, rollout)
    mask = rollout.response_mask.bool()
    torch.testing.assert_close(rollout.values[mask], values[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(rollout.bootstrap_value, bootstrap, atol=1e-5, rtol=0)
    assert (rollout.bootstrap_value != 0).any() == (boost == 1.5)

    # truncation as terminal never reads the bootstrap: no extra decode step for it, the same values
    def counted(**kwargs):
        forwards = []
        hook = model.register_forward_hook(lambda *_: forwards.append(1))
        try:
            rollout = generate(
                model, policy_tokenizer, prompts=PROMPTS * 2, max_new_tokens=8, seed=2, **kwargs
            )
            return len(forwards), rollout
        finally:
            hook.remove()

    n_with, _ = counted(value_model=value_model)
    n_terminal, terminal = counted(value_model=value_model, bootstrap_values=False)
    assert n_terminal == n_with - (boost == 1.5)
    assert torch.equal(terminal.response_ids, rollout.response_ids)
    torch.testing.assert_close(terminal.values[mask], rollout.values[mask])
    assert not terminal.bootstrap_value.any()
    with pytest.raises(ValueError, match="own trunk"):
        HFGenerator(model, policy_tokenizer, max_new_tokens=4, value_model=ValueModel.from_causal_lm(model))


def test_sequence_logprobs_micro_batching_and_temperature(policy_tokenizer, policy_model, make_causal_lm):
    rollout = generate(policy_model, policy_tokenizer, temperature=0.7)
    reference = make_causal_lm(policy_tokenizer, seed=5)
    whole = sequence_logprobs(reference, rollout)
    torch.testing.assert_close(sequence_logprobs(reference, rollout, forward_batch_size=3), whole)
    for b in range(len(rollout)):
        n = rollout.response_lengths[b]
        torch.testing.assert_close(
            whole[b, :n], teacher_forced_logprobs(reference, rollout, b, 0.7), atol=LOGP_TOL, rtol=0
        )
    assert not torch.allclose(sequence_logprobs(reference, rollout, temperature=1.0), whole)


def test_stored_passes_within_a_token_budget_equal_one_pass(policy_tokenizer, policy_model, boosted):
    """Rows regrouped by length and trimmed, results put back in their rows' places."""
    model = boosted(policy_model, policy_tokenizer.eos_token_id, 1.5)  # responses of mixed lengths
    rollout = generate(model, policy_tokenizer, prompts=PROMPTS * 2, max_new_tokens=8, seed=2)
    assert rollout.response_lengths.unique().numel() > 2
    value_model = ValueModel.from_causal_lm(model)
    torch.nn.init.normal_(value_model.head.weight)
    mask = rollout.response_mask.bool()
    whole_logp = sequence_logprobs(model, rollout)
    whole_values, whole_bootstrap = value_predictions(value_model, rollout)
    width = rollout.query_ids.shape[1] + rollout.response_ids.shape[1]
    for budget in (1, width + 1, 3 * width):  # one row each, a row or so, several
        logp = sequence_logprobs(model, rollout, forward_batch_tokens=budget)
        values, bootstrap = value_predictions(value_model, rollout, forward_batch_tokens=budget)
        torch.testing.assert_close(logp[mask], whole_logp[mask], atol=1e-5, rtol=0)
        torch.testing.assert_close(values[mask], whole_values[mask], atol=1e-5, rtol=0)
        torch.testing.assert_close(bootstrap, whole_bootstrap, atol=1e-5, rtol=0)


def test_balanced_assignment_evens_out_the_ranks_tokens():
    tokens = [90, 10, 10, 10, 40, 40, 10, 30]
    two = balanced_assignment(tokens, 2)
    assert sorted(r for rows in two for r in rows) == list(range(8))
    loads = [sum(tokens[r] for r in rows) for rows in two]
    assert max(loads) - min(loads) <= max(tokens) and loads == [120, 120]
    assert all(balanced_assignment([5, 1], 2))  # every rank gets a row


def test_concat_rollouts_pads_each_part_and_keeps_every_real_token(policy_tokenizer, policy_model):
    rollout = generate(policy_model, policy_tokenizer, prompts=PROMPTS * 2, max_new_tokens=8, seed=1)
    rollout.values = torch.randn(rollout.response_ids.shape)
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


def test_rollout_tensors_feed_the_update_with_autograd(policy_tokenizer, policy_model):
    """Tensors made under inference_mode cannot be saved for backward; the rollout's must be normal."""
    policy_model.train()
    rollout = generate(policy_model, policy_tokenizer)
    value_model = ValueModel.from_causal_lm(policy_model)
    logp_ref = sequence_logprobs(policy_model, rollout)
    values, bootstrap = value_predictions(value_model, rollout)
    logits = response_logits(policy_model, rollout)
    logp_new = token_logprobs(logits, rollout.response_ids)
    loss = ((logp_new - rollout.logp_old) * rollout.response_mask).sum() + (logp_new * logp_ref).sum()
    v_new = value_model(*rollout.sequence_inputs())[:, rollout.query_ids.shape[1] - 1 : -1]
    loss = loss + ((v_new - values) ** 2 * rollout.response_mask).sum() + bootstrap.sum()
    loss.backward()
    assert policy_model.lm_head.weight.grad is not None and value_model.head.weight.grad is not None


@pytest.mark.parametrize("lora", [False, True])
def test_shared_trunk_gives_logprobs_and_values_from_one_backbone_pass(policy_tokenizer, policy_model, lora):
    policy = apply_lora(policy_model, r=2, alpha=4) if lora else policy_model
    rollout = generate(policy, policy_tokenizer, temperature=0.7)
    value_model = ValueModel.shared_trunk(policy)
    torch.nn.init.normal_(value_model.head.weight)
    calls = []
    hook = policy.get_decoder().register_forward_hook(lambda *_: calls.append(1))
    logp, entropy, values = policy_logprobs_and_values(policy, value_model, rollout)
    hook.remove()
    assert len(calls) == 1
    with torch.no_grad():
        torch.testing.assert_close((logp, entropy), response_logprobs(policy, rollout))
    stored, _ = value_predictions(value_model, rollout)
    torch.testing.assert_close(values.detach(), stored, atol=1e-5, rtol=0)
    (logp.mean() + entropy.mean() + values.mean()).backward()
    assert all(p.grad is not None for p in trainable_parameters(policy, value_model))


# --------------------------------------------------------------------------------------------------
# The Rollout container
# --------------------------------------------------------------------------------------------------


def test_select_minibatches_and_to(policy_tokenizer, policy_model):
    rollout = generate(policy_model, policy_tokenizer, prompts=PROMPTS * 2)
    rollout.advantages = torch.arange(len(rollout), dtype=torch.float32)[:, None].expand(-1, 3)
    picked = rollout.select([5, 1])
    assert len(picked) == 2 and picked.prompts == [rollout.prompts[5], rollout.prompts[1]]
    assert torch.equal(picked.logp_old, rollout.logp_old[[5, 1]])
    assert picked.advantages[:, 0].tolist() == [5.0, 1.0]
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


# --------------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------------


def test_prompt_longer_than_the_context_window(policy_tokenizer, policy_model):
    long_prompt = " ".join(["cat"] * 200)  # context window 128
    with pytest.raises(LmppoError, match=r"prompt 1 of the batch is \d+ tokens .* limit of 120"):
        generate(policy_model, policy_tokenizer, prompts=["good", long_prompt], max_new_tokens=8)
    rollout = generate(
        policy_model, policy_tokenizer, prompts=["good", long_prompt], max_new_tokens=8, truncate_prompts=True
    )
    assert rollout.query_mask[1].sum() == 120
    assert rollout.query_ids[1, -1] == policy_tokenizer.convert_tokens_to_ids(
        "<|assistant|>"
    )  # the end is kept
    with pytest.raises(LmppoError, match="context window"):
        HFGenerator(policy_model, policy_tokenizer, max_new_tokens=8, max_prompt_length=125)


def test_tokenizer_without_chat_template(make_policy_tokenizer, policy_model):
    tokenizer = make_policy_tokenizer(chat_template=None)
    with pytest.raises(LmppoError, match="no chat template"):
        HFGenerator(policy_model, tokenizer, max_new_tokens=4)
    raw = HFGenerator(policy_model, tokenizer, max_new_tokens=4, raw_prompts=True)
    assert raw.render("good cat") == tokenizer("good cat").input_ids
    given = HFGenerator(
        policy_model, tokenizer, max_new_tokens=4, chat_template="{{ messages[0]['content'] }} <|assistant|>"
    )
    assert given.render("good cat") == tokenizer("good cat <|assistant|>").input_ids


def test_invalid_sampling_settings(policy_tokenizer, policy_model):
    with pytest.raises(LmppoError, match="temperature"):
        HFGenerator(policy_model, policy_tokenizer, max_new_tokens=4, temperature=0.0)
    with pytest.raises(LmppoError, match="top_p"):
        HFGenerator(policy_model, policy_tokenizer, max_new_tokens=4, top_p=0.0)
    with pytest.raises(LmppoError, match="no prompts"):
        HFGenerator(policy_model, policy_tokenizer, max_new_tokens=4).generate([], policy_version=0)


def test_the_prefill_projects_contiguous_rows_onto_the_vocabulary(policy_tokenizer, policy_model):
    """``hidden[:, -1:]`` of a multi-token forward is a strided view, and a linear on it runs as a batched
    matmul over an expanded copy of the LM head (100x slower in bf16): the loop hands it copied rows."""
    inputs = []
    hook = policy_model.lm_head.register_forward_pre_hook(lambda _, args: inputs.append(args[0]))
    generate(policy_model, policy_tokenizer, max_new_tokens=3)
    hook.remove()
    assert len(inputs) >= 2 and inputs[0].shape[1] == 1
    assert all(x.is_contiguous() for x in inputs)
