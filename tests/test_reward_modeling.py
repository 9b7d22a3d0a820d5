"""Reward modelling: Bradley–Terry training, where the score is read, evaluation slices, JSONL loading."""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest
import torch
from safetensors import safe_open

from lmppo.errors import LmppoError
from lmppo.inputs.config import SupervisedConfig
from lmppo.modeling.loading import load_reward_model
from lmppo.modeling.lora import with_lora
from lmppo.rewards.scoring import RewardModelScorer, render_for_reward_model
from lmppo.toy import task
from lmppo.toy.models import build_policy, reward_model_from_policy
from lmppo.toy.tokenizer import policy_tokenizer, reward_tokenizer, train_bpe
from lmppo.training import reward_modeling
from lmppo.training.reward_modeling import (
    bradley_terry_loss,
    evaluate_reward_model,
    load_preference_jsonl,
    run_train_rm,
    sequence_scores,
    train_reward_model,
)
from lmppo.training.sft import train_sft
from lmppo.training.supervised import merged, pad


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(task.tokenizer_corpus(0))


@pytest.fixture
def tiny_rm(bpe):
    return reward_model_from_policy(
        build_policy(policy_tokenizer(bpe), seed=0, hidden_size=32), reward_tokenizer(bpe), seed=0
    )


def test_bradley_terry_loss():
    zero = torch.zeros(3)
    assert bradley_terry_loss(zero, zero).item() == pytest.approx(math.log(2))
    assert bradley_terry_loss(torch.tensor([20.0]), torch.tensor([0.0])).item() < 1e-8
    chosen, rejected = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    bradley_terry_loss(chosen, rejected).backward()
    assert (chosen.grad < 0).all() and (rejected.grad > 0).all()  # descent raises chosen, lowers rejected


@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_score_is_read_at_the_last_real_token_whatever_the_padding(bpe, tiny_rm, pad_is_eos):
    tok = reward_tokenizer(bpe)
    if pad_is_eos:
        tok.pad_token = tok.eos_token
    rows = [tok(text)["input_ids"] + [tok.eos_token_id] for text in ("count to 3", "1 2 3 4 5 6 7 8.", "hi")]
    alone = torch.cat(
        [sequence_scores(tiny_rm, torch.tensor([r]), torch.ones(1, len(r), dtype=torch.long)) for r in rows]
    )
    for side in ("left", "right"):
        ids, mask = pad(rows, tok.pad_token_id, side), pad([[1] * len(r) for r in rows], 0, side)
        assert torch.allclose(sequence_scores(tiny_rm, ids, mask), alone, atol=1e-5), side
    # transformers' own pooling agrees where it can: right padding with pad != EOS
    if not pad_is_eos:
        ids, mask = pad(rows, tok.pad_token_id, "right"), pad([[1] * len(r) for r in rows], 0, "right")
        with torch.no_grad():
            assert torch.allclose(
                tiny_rm(input_ids=ids, attention_mask=mask).logits.squeeze(-1), alone, atol=1e-5
            )


def test_training_and_scoring_render_with_the_reward_models_own_template(bpe, tiny_rm):
    reward_tok, policy_tok = reward_tokenizer(bpe), policy_tokenizer(bpe)
    prompt, response = [{"role": "user", "content": "count to 3"}], "1 2 3."
    text = render_for_reward_model(reward_tok, prompt, response)
    assert text == "<bos>user:\ncount to 3\nassistant:\n1 2 3.<eos>"
    ids = torch.tensor([reward_tok(text, add_special_tokens=False)["input_ids"]])
    scored = RewardModelScorer(tiny_rm, reward_tok)([prompt], [response])
    assert torch.allclose(scored, sequence_scores(tiny_rm, ids, torch.ones_like(ids)).detach(), atol=1e-6)
    assert not torch.allclose(scored, RewardModelScorer(tiny_rm, policy_tok)([prompt], [response]))


def test_train_reward_model_lowers_the_bradley_terry_loss(bpe, tiny_rm):
    pairs = task.preference_pairs(256, seed=0, split="train", label_noise=0.0)
    stats = train_reward_model(
        tiny_rm, reward_tokenizer(bpe), pairs, epochs=4, lr=1e-2, batch_size=32, seed=0
    )
    assert stats["steps"] == 32 and not tiny_rm.training
    first, last = statistics.mean(stats["loss"][:8]), statistics.mean(stats["loss"][-8:])
    assert last < first - 0.1 and statistics.mean(stats["accuracy"][-8:]) > 0.6


def test_evaluation_reports_accuracy_and_rewards_per_slice(bpe, tiny_rm):
    pairs = task.preference_pairs(120, seed=0, split="test", label_noise=0.0)
    result = evaluate_reward_model(tiny_rm, reward_tokenizer(bpe), pairs, batch_size=32)
    assert result["n"] == 120 and set(result["slices"]) == {"type", "length_bucket"}
    for slices in result["slices"].values():
        assert sum(s["n"] for s in slices.values()) == 120
        weighted = sum(s["accuracy"] * s["n"] for s in slices.values()) / 120
        assert weighted == pytest.approx(result["accuracy"])
    assert set(result["slices"]["type"]) == set(task.KINDS)
    reward = result["reward"]
    assert reward["q10"] <= reward["q50"] <= reward["q90"] and reward["std"] > 0
    assert result["margin_mean"] == pytest.approx(result["chosen_mean"] - result["rejected_mean"], abs=1e-5)


def test_slices_are_skipped_when_rows_lack_the_tag(bpe, tiny_rm):
    pairs = [
        {"prompt": "count to 3", "chosen": "1 2 3.", "rejected": "1 2.", "type": "count"},
        {"prompt": "count to 4", "chosen": "1 2 3 4.", "rejected": "no."},
    ]
    assert evaluate_reward_model(tiny_rm, reward_tokenizer(bpe), pairs)["slices"] == {}


# --------------------------------------------------------------------------------------------------
# Preference JSONL
# --------------------------------------------------------------------------------------------------


def write_rows(path, rows) -> str:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_load_preference_jsonl_accepts_text_and_chat_prompts(tmp_path):
    rows = [
        {"prompt": "count to 2", "chosen": "1 2.", "rejected": "1."},
        {
            "prompt": [{"role": "user", "content": "say hi 2 times"}],
            "chosen": "hi hi.",
            "rejected": "hi.",
            "type": "repeat",
        },
    ]
    assert (
        load_preference_jsonl(write_rows(tmp_path / "p.jsonl", [*rows, ""])) == rows
    )  # blank lines are skipped


@pytest.mark.parametrize(
    ("bad_row", "message"),
    [
        ({"prompt": "count to 2", "rejected": "1."}, "line 2: missing key 'chosen'"),
        ({"chosen": "1 2.", "rejected": "1."}, "line 2 has no prompt"),
        (
            {"prompt": "count to 2", "chosen": ["1 2."], "rejected": "1."},
            "line 2: 'chosen' must be the response text",
        ),
        ('{"prompt": "count to 2", "chosen": ', "line 2: not valid JSON"),
        (["not", "an", "object"], "line 2: each line must be a JSON object"),
    ],
)
def test_load_preference_jsonl_names_the_file_row_and_problem(tmp_path, bad_row, message):
    path = write_rows(tmp_path / "prefs.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}, bad_row])
    with pytest.raises(LmppoError, match=message) as err:
        load_preference_jsonl(path)
    assert "prefs.jsonl" in str(err.value)


def test_load_preference_jsonl_refuses_missing_and_empty_files(tmp_path):
    with pytest.raises(LmppoError, match="does not exist"):
        load_preference_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(LmppoError, match="holds no usable preference pairs: it has no lines"):
        load_preference_jsonl(write_rows(tmp_path / "empty.jsonl", [""]))


def test_identical_chosen_and_rejected_are_skipped_with_a_warning(tmp_path):
    rows = [
        {"prompt": "count to 2", "chosen": "1 2.", "rejected": "1."},
        {"prompt": "q", "chosen": "a", "rejected": "a"},
    ]
    with pytest.warns(UserWarning, match="skipped 1 pairs whose chosen and rejected responses are identical"):
        pairs = load_preference_jsonl(write_rows(tmp_path / "ties.jsonl", rows))
    assert [p["chosen"] for p in pairs] == ["1 2."]
    with pytest.raises(
        LmppoError,
        match=r"no usable preference pairs: in every line chosen and rejected are the same text \(.*all_ties.jsonl, line 1\)",
    ):
        load_preference_jsonl(write_rows(tmp_path / "all_ties.jsonl", rows[1:]))


# --------------------------------------------------------------------------------------------------
# `lmppo train-rm` with LoRA
# --------------------------------------------------------------------------------------------------

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # config.LoraConfig's default target_modules


def test_lora_train_rm_trains_adapters_and_head_only_and_saves_a_merged_reward_model(
    bpe, tmp_path, monkeypatch
):
    tok = reward_tokenizer(bpe)
    base = build_policy(tok, seed=0, hidden_size=32)  # a causal LM checkpoint: train-rm adds the score head
    base.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    held_out = task.preference_pairs(16, seed=0, split="test", label_noise=0.0)
    cfg = SupervisedConfig(
        model={"path": str(tmp_path / "base")},
        data=write_rows(
            tmp_path / "train.jsonl", task.preference_pairs(32, seed=0, split="train", label_noise=0.0)
        ),
        eval_data=write_rows(tmp_path / "test.jsonl", held_out),
        output_dir=str(tmp_path / "rm"),
        epochs=2,
        lr=1e-2,
        batch_size=16,
        lora={"enabled": True, "r": 4},
    )
    prompts, responses = [p["prompt"] for p in held_out], [p["chosen"] for p in held_out]
    seen = {}

    def remember_head(model, lora):
        seen["head"] = model.score.weight.detach().clone()
        return with_lora(model, lora)

    def score_then_merge(model):  # the trained model, adapters not yet merged
        seen["scores"] = RewardModelScorer(model, tok)(prompts, responses)
        return merged(model)

    monkeypatch.setattr(reward_modeling, "with_lora", remember_head)
    monkeypatch.setattr(reward_modeling, "merged", score_then_merge)
    stats = run_train_rm(cfg)

    out = tmp_path / "rm"
    assert not list(out.glob("adapter*")) and not (out / "README.md").exists()  # no peft files: merged
    assert json.loads((out / "config.json").read_text())["architectures"] == [
        "LlamaForSequenceClassification"
    ]
    with safe_open(out / "model.safetensors", "pt") as saved:
        keys = saved.keys()  # safe_open is not iterable
        assert not [k for k in keys if "lora_" in k or "modules_to_save" in k or "original_module" in k]
    rm = load_reward_model(out)
    # only the adapted projections (merged) and the whole score head changed; the rest is the base
    for name, weight in rm.model.state_dict().items():
        adapted = name.endswith(tuple(f"{t}.weight" for t in LORA_TARGETS))
        assert torch.equal(weight, base.model.state_dict()[name]) != adapted, name
    assert not torch.equal(rm.score.weight, seen["head"])
    adapters = sum(
        4 * (m.in_features + m.out_features) for n, m in rm.named_modules() if n.endswith(LORA_TARGETS)
    )
    assert stats["trained_parameters"] == adapters + rm.score.weight.numel()
    # the saved model scores as the trained one did, and the held-out evaluation is of that model
    assert torch.allclose(RewardModelScorer(rm, tok)(prompts, responses), seen["scores"], atol=1e-5)
    assert stats["eval"] == json.loads((out / "rm_eval.json").read_text())
    assert stats["eval"]["accuracy"] == pytest.approx(evaluate_reward_model(rm, tok, held_out)["accuracy"])


# --------------------------------------------------------------------------------------------------
# The toy recipe end to end
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_toy_reward_model_agrees_with_gold_and_loves_the_hackable_feature(bpe):
    """SFT, then a reward model from the SFT transformer: held-out accuracy against the gold judge >= 0.75,
    and it scores "sure!" repeated past what the data showed above the best answers (room for hacking)."""
    data = task.toy_datasets(0)
    policy = build_policy(policy_tokenizer(bpe), seed=0)
    train_sft(policy, policy_tokenizer(bpe), data["sft_train"], epochs=8, lr=2e-3, batch_size=32, seed=0)
    rm, tok = reward_model_from_policy(policy, reward_tokenizer(bpe), seed=0), reward_tokenizer(bpe)
    train_reward_model(rm, tok, data["prefs_train"], epochs=3, lr=1e-3, batch_size=32, seed=0)
    result = evaluate_reward_model(rm, tok, data["prefs_test"])
    assert result["accuracy"] >= 0.75
    assert all(s["accuracy"] > 0.6 for s in result["slices"]["type"].values())

    rng = random.Random(0)
    tasks = rng.sample(task.split_tasks(0)["test"], 30)
    best = [task.render(t, task.ideal_items(t, rng), "sure! sure!") for t in tasks]  # gold 2.7, the maximum
    prompts, scorer = [t.text for t in tasks], RewardModelScorer(rm, tok)
    scores, gold = {}, {}
    for extra in (0, 2, 4):  # "sure" beyond the two the data ever shows
        hacked = ["sure! " * extra + r for r in best]
        scores[extra] = scorer(prompts, hacked)
        gold[extra] = statistics.mean(task.gold_score(p, r) for p, r in zip(prompts, hacked))
    assert gold[0] == pytest.approx(2.7) and gold[4] < gold[2] < gold[0] - 1
    assert scores[0].mean() < scores[2].mean() < scores[4].mean()  # the RM likes it more as gold falls
    assert (scores[4] > scores[0]).float().mean() > 0.75
