"""Reward model scoring on text, programmatic rewards, score transforms."""

from __future__ import annotations

import math
import random

import pytest
import torch

from lmppo.errors import LmppoError
from lmppo.rewards.scoring import (
    CombinedReward,
    RewardModelScorer,
    ScoredComponent,
    ScoreTransform,
    load_reward_function,
    render_for_reward_model,
)
from lmppo.sampling.hf_engine import hf_generator

PROMPTS = ["tell me about the dog", [{"role": "user", "content": "write a poem"}], "sad day", "good"]
RESPONSES = ["good good dog", "red sun and blue night", "it was a very happy day", "bad"]


def rendered_ids(tokenizer, prompt, response) -> torch.Tensor:
    text = render_for_reward_model(tokenizer, prompt, response)
    return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids  # (1, T)


def direct_score(reward_model, tokenizer, prompt, response, keep_last: int | None = None) -> float:
    """Independent check: one unpadded rendering, the score head at its last position."""
    ids = rendered_ids(tokenizer, prompt, response)[:, -(keep_last or 0) :]
    with torch.no_grad():
        hidden = reward_model.model(input_ids=ids).last_hidden_state
        return float(reward_model.score(hidden)[0, -1, 0])


def test_reward_model_scores_its_own_rendering_of_the_text(
    reward_tokenizer, make_reward_model, make_causal_lm, policy_tokenizer, make_policy_tokenizer
):
    reward_model = make_reward_model(reward_tokenizer)
    scorer = RewardModelScorer(reward_model, reward_tokenizer, batch_size=3)
    text = render_for_reward_model(reward_tokenizer, PROMPTS[0], RESPONSES[0])
    assert text == "[Q] tell me about the dog [A] good good dog [EOS]"  # the RM's template, not the policy's
    scores = scorer(PROMPTS, RESPONSES)
    assert scores.shape == (4,) and scores.dtype == torch.float32
    expected = [direct_score(reward_model, reward_tokenizer, p, r) for p, r in zip(PROMPTS, RESPONSES)]
    torch.testing.assert_close(scores, torch.tensor(expected), atol=1e-5, rtol=0)
    for budget in (1, 12, 40):  # grouped by length within a token budget: the same scores, in row order
        budgeted = RewardModelScorer(reward_model, reward_tokenizer, batch_tokens=budget)
        torch.testing.assert_close(budgeted(PROMPTS, RESPONSES), scores, atol=1e-5, rtol=0)

    # Policies with different vocabularies tokenise the responses differently; the scores follow the text.
    vocab = policy_tokenizer.get_vocab()
    shuffled = [w for w in sorted(vocab, key=vocab.get) if w not in policy_tokenizer.all_special_tokens]
    random.Random(0).shuffle(shuffled)
    other_policy_tokenizer = make_policy_tokenizer(words=shuffled)
    assert policy_tokenizer(RESPONSES[0]).input_ids != other_policy_tokenizer(RESPONSES[0]).input_ids
    for tokenizer in (policy_tokenizer, other_policy_tokenizer):
        decoded = [tokenizer.decode(tokenizer(r).input_ids) for r in RESPONSES]
        torch.testing.assert_close(scorer(PROMPTS, decoded), scores)

    # End to end: a rollout's texts are scored, never its ids (which mean other words to this RM).
    rollout = hf_generator(make_causal_lm(policy_tokenizer), policy_tokenizer, max_new_tokens=6).generate(
        PROMPTS, 0
    )
    from_texts = scorer(rollout.prompts, rollout.response_texts)
    expected = [
        direct_score(reward_model, reward_tokenizer, p, r)
        for p, r in zip(rollout.prompts, rollout.response_texts)
    ]
    torch.testing.assert_close(from_texts, torch.tensor(expected), atol=1e-5, rtol=0)
    with torch.no_grad():
        policy_ids_fed_to_rm = reward_model(input_ids=rollout.response_ids[:1]).logits[0, 0]
    assert not torch.isclose(policy_ids_fed_to_rm, from_texts[0], atol=1e-3)


def test_score_is_read_at_the_last_real_token_when_pad_is_eos(reward_tokenizer, make_reward_model):
    """The RM template ends with EOS == pad: pooling by ``ids != pad`` would read the token before it."""
    reward_model = make_reward_model(reward_tokenizer)
    scorer = RewardModelScorer(reward_model, reward_tokenizer)
    scores = scorer(PROMPTS, RESPONSES)
    alone = torch.cat([scorer([p], [r]) for p, r in zip(PROMPTS, RESPONSES)])
    torch.testing.assert_close(scores, alone, atol=1e-5, rtol=0)  # padding in a batch changes nothing
    ids = rendered_ids(reward_tokenizer, PROMPTS[2], RESPONSES[2])
    assert ids[0, -1] == reward_tokenizer.pad_token_id
    with torch.no_grad():
        pooled_by_pad_id = reward_model(input_ids=ids).logits[0, 0]  # transformers' own pooling
    assert not torch.isclose(pooled_by_pad_id, scores[2], atol=1e-4)


def test_long_renderings_keep_their_end(reward_tokenizer, make_reward_model):
    reward_model = make_reward_model(reward_tokenizer)
    scorer = RewardModelScorer(reward_model, reward_tokenizer, max_length=6)
    assert rendered_ids(reward_tokenizer, PROMPTS[0], RESPONSES[0]).shape[1] > 6
    with pytest.warns(UserWarning, match="keeping their last tokens"):
        score = scorer(PROMPTS[:1], RESPONSES[:1])
    expected = direct_score(reward_model, reward_tokenizer, PROMPTS[0], RESPONSES[0], keep_last=6)
    assert float(score[0]) == pytest.approx(expected, abs=1e-5)
    assert float(score[0]) != pytest.approx(
        direct_score(reward_model, reward_tokenizer, PROMPTS[0], RESPONSES[0])
    )


def test_reward_tokenizer_without_template(reward_tokenizer, make_reward_model):
    reward_tokenizer.chat_template = None
    with pytest.raises(LmppoError, match="no chat template"):
        RewardModelScorer(make_reward_model(reward_tokenizer), reward_tokenizer)
    scorer = RewardModelScorer(make_reward_model(reward_tokenizer), reward_tokenizer, chats=False)
    with pytest.raises(LmppoError, match="no chat template"):
        scorer([[{"role": "user", "content": "good"}]], ["bad"])
    assert scorer.score_ids([scorer.render_query("[Q] good [A] bad [EOS]")]).shape == (1,)  # whole texts


# --------------------------------------------------------------------------------------------------
# Programmatic rewards
# --------------------------------------------------------------------------------------------------


def test_a_module_function_through_the_loader():
    reward = load_reward_function("helpers:count_good")  # tests/ is on sys.path: a plain module spec
    scores = reward(["p", "q", "r"], ["good good goods, Good.", "bad", "not good"])
    assert scores.tolist() == [3.0, 0.0, 1.0] and scores.dtype == torch.float32
    assert reward([], []).tolist() == []


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
    (tmp_path / "user_rewards.py").write_text(
        "short = lambda prompts, responses: [1.0]\n"
        "nan = lambda prompts, responses: [0.0, float('nan')]\n"
        "text = lambda prompts, responses: 'high'\n"
        "length = lambda prompts, responses: [len(r) for r in responses]\n"
        "NOT_A_FUNCTION = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_colon", "must look like 'package.module:function' or 'path/to/file.py:function'"),
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("user_rewards:missing", "has no attribute 'missing'"),
        ("user_rewards:NOT_A_FUNCTION", "is a int, not a function"),
    ],
)
def test_reward_function_spec_errors(user_rewards, spec, message):
    with pytest.raises(LmppoError, match=message):
        load_reward_function(spec)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("user_rewards:short", "returned 1 scores for 2 responses"),
        ("user_rewards:text", "returned str"),
    ],
)
def test_reward_function_output_errors_name_the_function(user_rewards, spec, message):
    reward = load_reward_function(spec)
    with pytest.raises(LmppoError, match=f"reward function {spec} {message}"):
        reward(["a", "b"], ["x", "y"])


def test_a_non_finite_score_is_refused_naming_the_reward_the_rows_and_the_fix(user_rewards):
    function = load_reward_function("user_rewards:nan")
    assert torch.isfinite(function(["a", "b"], ["x", "y"])).tolist() == [True, False]  # as returned
    reward = CombinedReward([ScoredComponent("reward", function, source="reward function user_rewards:nan")])
    with pytest.raises(LmppoError) as refused:
        reward(["say hi", "say bye"], ["hi", "bye"])  # training, the pre-flight and evaluation score so
    assert str(refused.value).startswith(
        "reward function user_rewards:nan scored 1 of 2 responses with a non-finite value, e.g. nan for "
        "prompt 'say bye' and response 'bye'."
    )
    assert "fix the reward" in str(refused.value)


def test_reward_function_from_a_file_path(tmp_path, monkeypatch):
    (tmp_path / "my_reward.py").write_text(
        "IMPORTS = []\nIMPORTS.append(1)\ndef score(prompts, responses):\n"
        "    return [len(r) + len(IMPORTS) for r in responses]\n"
    )
    monkeypatch.chdir(tmp_path)  # a relative path starts at the working directory
    assert load_reward_function("my_reward.py:score")(["a"], ["xy"]).tolist() == [3.0]
    assert load_reward_function(f"{tmp_path}/my_reward.py:score")(["a"], ["xy"]).tolist() == [
        3.0
    ]  # imported once
    with pytest.raises(LmppoError, match="no file .*missing.py"):
        load_reward_function("missing.py:score")


def test_reward_function_accepts_ints(user_rewards):
    assert load_reward_function("user_rewards:length")(["a", "b"], ["xyz", ""]).tolist() == [3.0, 0.0]


# --------------------------------------------------------------------------------------------------
# Score transforms
# --------------------------------------------------------------------------------------------------


def test_score_transform_is_off_by_default():
    scores = torch.tensor([1.0, -5.0, 30.0])
    out, info = ScoreTransform()(scores, torch.tensor([True, False, True]))
    assert torch.equal(out, scores) and info == {}


def test_missing_eos_penalty_and_clip():
    transform = ScoreTransform(missing_eos_penalty=1.0, clip=2.0)
    out, info = transform(torch.tensor([0.5, 0.5, 5.0, -3.0]), torch.tensor([True, False, True, True]))
    assert out.tolist() == [0.5, -0.5, 2.0, -2.0]
    assert info == {"reward/eos_penalty_frac": 0.25, "reward/clip_frac": 0.5}


def test_running_normalisation_matches_all_scores_seen_and_resumes():
    torch.manual_seed(0)
    batches = [torch.randn(8) * 3 + 2, torch.randn(5) * 3 + 2, torch.randn(11) * 3 + 2]
    terminated = [torch.ones(len(b), dtype=torch.bool) for b in batches]
    transform = ScoreTransform(normalize=True)
    for scores, done in zip(batches[:2], terminated):
        transform(scores, done)
    resumed = ScoreTransform(normalize=True)
    resumed.load_state_dict(transform.state_dict())
    out, info = transform(batches[2], terminated[2])
    out_resumed, _ = resumed(batches[2], terminated[2])
    seen = torch.cat(batches)
    assert info["reward/norm_mean"] == pytest.approx(float(seen.mean()), abs=1e-5)
    assert info["reward/norm_std"] == pytest.approx(float(seen.std(unbiased=False)), abs=1e-5)
    torch.testing.assert_close(out, (batches[2] - seen.mean()) / seen.std(unbiased=False), atol=1e-5, rtol=0)
    torch.testing.assert_close(out_resumed, out)


# --------------------------------------------------------------------------------------------------
# Several rewards at once
# --------------------------------------------------------------------------------------------------


def length_score(prompts, responses) -> torch.Tensor:
    return torch.tensor([float(len(r.split())) for r in responses])


def good_score(prompts, responses) -> torch.Tensor:
    return torch.tensor([float(r.split().count("good")) for r in responses])


def test_the_last_token_score_is_the_weighted_sum_of_each_components_preprocessed_score():
    good = ScoredComponent("good", good_score, 2.0, ScoreTransform(normalize=True))
    length = ScoredComponent("length", length_score, -0.5, ScoreTransform(missing_eos_penalty=1.0, clip=3.0))
    reward = CombinedReward([good, length], named=True)
    terminated = torch.tensor([True, False, True, True])
    raw = reward.raw_scores(PROMPTS, RESPONSES)
    assert raw["good"].tolist() == [2.0, 0.0, 0.0, 0.0] and raw["length"].tolist() == [3.0, 5.0, 6.0, 1.0]
    score, per_row, stats = reward.shape(raw, terminated)
    good_used = (raw["good"] - 0.5) / math.sqrt(0.75 + 1e-8)  # normalised by this batch: mean 0.5, var 0.75
    length_used = torch.tensor([3.0, 3.0, 3.0, 1.0])  # 5 - 1 (no EOS) = 4 and 6: both clipped to 3
    torch.testing.assert_close(score, 2.0 * good_used - 0.5 * length_used)
    torch.testing.assert_close(per_row["reward/length/used"], -0.5 * length_used)
    assert per_row["reward/good/raw"].tolist() == raw["good"].tolist()
    assert stats["reward/good/norm_mean"] == 0.5 and stats["reward/length/clip_frac"] == 0.5
    assert reward(PROMPTS, RESPONSES).tolist() == (2.0 * raw["good"] - 0.5 * raw["length"]).tolist()

    resumed = CombinedReward(
        [ScoredComponent("good", good_score, 2.0, ScoreTransform(normalize=True)), length], named=True
    )
    resumed.load_state_dict(reward.state_dict())  # the running normalisation goes on where it was
    torch.testing.assert_close(resumed.shape(raw, terminated)[0], reward.shape(raw, terminated)[0])


def test_the_gate_gives_rows_below_its_threshold_the_gate_components_score_alone():
    safety = ScoredComponent("safety", good_score, 1.0)
    helpful = ScoredComponent("helpful", length_score, 1.0)
    reward = CombinedReward([safety, helpful], gate=("safety", 0.5), named=True)
    score, per_row, _ = reward.shape(reward.raw_scores(PROMPTS, RESPONSES), torch.ones(4, dtype=torch.bool))
    assert score.tolist() == [2.0 + 3.0, 0.0, 0.0, 0.0]  # only row 0 has safety >= 0.5: the sum
    assert per_row["reward/gate_frac"].tolist() == [0.0, 1.0, 1.0, 1.0]


def test_two_reward_models_each_score_their_own_rendering(
    tmp_path, reward_tokenizer, policy_tokenizer, make_reward_model
):
    """A learned RM per tokenizer and template: each sees the token ids of its own rendering of the text."""
    from lmppo.inputs.config import RewardConfig
    from lmppo.inputs.resolve import reward_roles
    from lmppo.runs.build import load_reward

    for name, tokenizer in (("bracket", reward_tokenizer), ("chat", policy_tokenizer)):
        make_reward_model(tokenizer).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    components = [{"name": n, "model": {"path": str(tmp_path / n)}} for n in ("bracket", "chat")]
    reward_cfg = RewardConfig(components=components)
    loaded = load_reward(reward_cfg, reward_roles(reward_cfg, "fp32"))
    seen: dict[str, list[list[int]]] = {}
    for component in loaded.reward.components:
        scorer, batches = component.score, seen.setdefault(component.name, [])
        scorer._score_batch = lambda rows, scorer=scorer, batches=batches: (  # record, then score
            batches.extend(rows) or RewardModelScorer._score_batch(scorer, rows)
        )
    raw = loaded.reward.raw_scores(PROMPTS, RESPONSES)
    for name, tokenizer in (("bracket", reward_tokenizer), ("chat", policy_tokenizer)):
        expected = [rendered_ids(tokenizer, p, r)[0].tolist() for p, r in zip(PROMPTS, RESPONSES)]
        assert seen[name] == expected and raw[name].shape == (4,)
    assert seen["bracket"] != seen["chat"]
    assert set(loaded.identity["components"]) == {"bracket", "chat"}
    assert (
        loaded.identity["components"]["chat"]["tokenizer_sha256"]
        != loaded.identity["components"]["bracket"]["tokenizer_sha256"]
    )
