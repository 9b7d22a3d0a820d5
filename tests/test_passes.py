"""The passes over a rollout: stored log-probs and values (dropout off, micro-batched, within a token
budget), a shared trunk's one backbone pass, and the update's autograd."""

from __future__ import annotations

import pytest
import torch
from rollout_samples import LOGP_TOL, PROMPTS, generate, teacher_forced_logprobs, unpadded

from lmppo.math.core import token_logprobs
from lmppo.modeling.lora import apply_lora
from lmppo.modeling.models import ValueModel, trainable_parameters
from lmppo.sampling.passes import (
    policy_logprobs_and_values,
    response_logits,
    response_logprobs,
    sequence_logprobs,
    value_predictions,
)


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
