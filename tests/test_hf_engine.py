"""The transformers engine: sampling log-probs, left padding, pad == EOS, the sampling processors, values
off the decode loop, prompts and settings refused; the pitfalls that bit TRL / OpenRLHF / veRL."""

from __future__ import annotations

import warnings

import pytest
import torch
from rollout_samples import LOGP_TOL, PROMPTS, generate, stop_ids, teacher_forced_logprobs, unpadded
from transformers import GPT2Config, GPT2LMHeadModel

from lmppo.errors import LmppoError, LmppoWarning
from lmppo.math.core import last_response_index, shaped_rewards, token_logprobs
from lmppo.modeling.models import ValueModel
from lmppo.sampling.hf_engine import hf_generator
from lmppo.sampling.passes import (
    response_logits,
    value_predictions,
)


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
    generator = hf_generator(make_causal_lm(tokenizer), tokenizer, max_new_tokens=4)
    rendered = [generator.renderer.render(p) for p in PROMPTS]
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
    rewards = shaped_rewards(rm_score, zeros, rollout.response_mask, beta=0.1)  # no KL
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
        generator = hf_generator(
            policy_model, policy_tokenizer, max_new_tokens=1, temperature=0.5, top_k=top_k, top_p=top_p
        )
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 0.2, -3.0])
    draws = 40_000
    torch.manual_seed(0)
    tokens, logp = generator.engine._draw(row.repeat(draws, 1))
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
        hf_generator(model, policy_tokenizer, max_new_tokens=4, value_model=ValueModel.from_causal_lm(model))


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
        hf_generator(policy_model, policy_tokenizer, max_new_tokens=8, max_prompt_length=125)


def test_tokenizer_without_chat_template(make_policy_tokenizer, policy_model):
    tokenizer = make_policy_tokenizer(chat_template=None)
    with pytest.raises(LmppoError, match="no chat template"):
        hf_generator(policy_model, tokenizer, max_new_tokens=4)
    raw = hf_generator(policy_model, tokenizer, max_new_tokens=4, raw_prompts=True)
    assert raw.renderer.render("good cat") == tokenizer("good cat").input_ids
    given = hf_generator(
        policy_model, tokenizer, max_new_tokens=4, chat_template="{{ messages[0]['content'] }} <|assistant|>"
    )
    assert given.renderer.render("good cat") == tokenizer("good cat <|assistant|>").input_ids


def test_invalid_sampling_settings(policy_tokenizer, policy_model):
    with pytest.raises(LmppoError, match="temperature"):
        hf_generator(policy_model, policy_tokenizer, max_new_tokens=4, temperature=0.0)
    with pytest.raises(LmppoError, match="top_p"):
        hf_generator(policy_model, policy_tokenizer, max_new_tokens=4, top_p=0.0)
    with pytest.raises(LmppoError, match="no prompts"):
        hf_generator(policy_model, policy_tokenizer, max_new_tokens=4).generate([], policy_version=0)


def test_the_prefill_projects_contiguous_rows_onto_the_vocabulary(policy_tokenizer, policy_model):
    """``hidden[:, -1:]`` of a multi-token forward is a strided view, and a linear on it runs as a batched
    matmul over an expanded copy of the LM head (100x slower in bf16): the loop hands it copied rows."""
    inputs = []
    hook = policy_model.lm_head.register_forward_pre_hook(lambda _, args: inputs.append(args[0]))
    generate(policy_model, policy_tokenizer, max_new_tokens=3)
    hook.remove()
    assert len(inputs) >= 2 and inputs[0].shape[1] == 1
    assert all(x.is_contiguous() for x in inputs)


def test_decode_batches_within_a_token_budget_sample_each_row_as_a_batch_of_its_own(
    policy_tokenizer, policy_model
):
    """rollout.generation_batch_tokens: a budget of one row's cache per batch; each row seeded by its own
    sample gets what generating it alone gets, and the batches join padded (values included)."""
    value_model = ValueModel.shared_trunk(policy_model)
    options = dict(
        max_new_tokens=8, stop_token_ids=stop_ids(policy_tokenizer), seed=5, value_model=value_model
    )
    one_row = len(policy_tokenizer(PROMPTS[0]).input_ids) + 8  # under any rendered prompt's cache
    batched = hf_generator(policy_model, policy_tokenizer, batch_tokens=one_row, **options)
    rollout = batched.generate(PROMPTS, policy_version=0)
    assert (
        batched.decode_budget.in_progress == rollout.query_mask[-1].sum() + 8
    )  # the last batch: its row alone
    assert rollout.values.shape == rollout.response_ids.shape
    for i, prompt in enumerate(PROMPTS):
        alone = hf_generator(policy_model, policy_tokenizer, **options).generate([prompt], 0, sample_ids=[i])
        n = int(alone.response_mask.sum())
        assert torch.equal(rollout.response_ids[i, :n], alone.response_ids[0, :n])
        assert rollout.response_mask[i].sum() == n
        torch.testing.assert_close(rollout.logp_old[i, :n], alone.logp_old[0, :n], atol=1e-6, rtol=0)
        torch.testing.assert_close(rollout.values[i, :n], alone.values[0, :n], atol=1e-5, rtol=0)
