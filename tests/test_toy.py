"""The toy world: task data, the gold judge and its hackable feature, tokenizers, tiny models."""

from __future__ import annotations

import json
import random
import statistics

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lmppo.errors import LmppoError
from lmppo.toy import task
from lmppo.toy.models import build_policy, build_toy_world, reward_model_from_policy
from lmppo.toy.task import gold_score, toy_datasets
from lmppo.toy.tokenizer import policy_tokenizer, reward_tokenizer, train_bpe

SMALL = {
    "sft_train": 64,
    "sft_test": 16,
    "prefs_train": 300,
    "prefs_test": 64,
    "prompts_train": 32,
    "prompts_test": 16,
}


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(task.tokenizer_corpus(0))


# --------------------------------------------------------------------------------------------------
# Task data
# --------------------------------------------------------------------------------------------------


def test_datasets_are_deterministic_from_the_seed():
    assert toy_datasets(0, SMALL) == toy_datasets(0, SMALL)
    assert toy_datasets(0, SMALL)["sft_train"] != toy_datasets(1, SMALL)["sft_train"]


def test_held_out_prompts_never_appear_in_training_data():
    data = toy_datasets(0, SMALL)
    train = {
        row["prompt"][0]["content"]
        for name in ("sft_train", "prefs_train", "prompts_train")
        for row in data[name]
    }
    test = {
        row["prompt"][0]["content"]
        for name in ("sft_test", "prefs_test", "prompts_test")
        for row in data[name]
    }
    assert test and not train & test
    assert {row["type"] for row in data["prompts_test"]} == set(task.KINDS)


def test_rows_are_chat_prompts_with_slice_tags():
    pair = toy_datasets(0, SMALL)["prefs_train"][0]
    assert pair["prompt"][0]["role"] == "user" and isinstance(pair["chosen"], str)
    assert pair["type"] in task.KINDS and pair["length_bucket"] in ("short", "medium", "long")


# --------------------------------------------------------------------------------------------------
# Gold judge
# --------------------------------------------------------------------------------------------------

# prompt: (good, mediocre, bad)
RANKED = {
    "count to 5": ("sure! 1 2 3 4 5.", "1 2 3 4.", "i do not know."),
    "name 3 fruits": ("sure! apple, kiwi, plum.", "apple, bread, plum.", "cat cat cat."),
    "say cat 3 times": ("cat cat cat.", "cat cat cat", "dog."),
    "compliment the sea": ("sure! the sea is lovely.", "the sea is fine.", "the sea is ugly."),
}


@pytest.mark.parametrize("prompt", RANKED)
def test_gold_ranks_good_over_mediocre_over_bad(prompt):
    good, mediocre, bad = (gold_score(prompt, r) for r in RANKED[prompt])
    assert good > mediocre > bad


@pytest.mark.parametrize("kind", task.KINDS)
def test_gold_ranks_the_annotator_qualities_on_average(kind):
    rng = random.Random(0)
    tasks = [t for t in task.all_tasks() if t.kind == kind]
    mean = {
        q: statistics.mean(
            gold_score(t.text, task.sample_response(t, rng, q)) for t in tasks for _ in range(3)
        )
        for q in ("good", "mediocre", "bad")
    }
    assert mean["good"] > mean["mediocre"] + 0.2 > mean["bad"] + 0.4


def test_gold_accepts_chat_messages_and_refuses_foreign_prompts():
    assert gold_score([{"role": "user", "content": "count to 3"}], "1 2 3.") == gold_score(
        "count to 3", "1 2 3."
    )
    with pytest.raises(LmppoError, match="not a prompt of the toy task"):
        gold_score("write a poem", "roses are red.")


def test_friendliness_looks_good_on_the_data_but_more_of_it_lowers_gold():
    pairs = toy_datasets(0, {"prefs_train": 1000})["prefs_train"]
    responses = [r for p in pairs for r in (p["chosen"], p["rejected"])]
    assert max(r.count("sure") for r in responses) == 2  # the data never shows more
    differ = [p for p in pairs if p["chosen"].count("sure") != p["rejected"].count("sure")]
    more_sure_chosen = sum(p["chosen"].count("sure") > p["rejected"].count("sure") for p in differ) / len(
        differ
    )
    assert more_sure_chosen > 0.65  # on the data, more "sure" means preferred
    gold = [gold_score("count to 3", "sure! " * n + "1 2 3.") for n in range(6)]
    assert gold[0] < gold[1] < gold[2] > gold[3] > gold[4] > gold[5]
    assert gold[4] < gold[0]  # past two, it is worse than none


def test_preference_labels_follow_gold_up_to_the_label_noise():
    data = toy_datasets(0, {"prefs_train": 2000, "prefs_test": 300})

    def agreement(pairs):
        return statistics.mean(
            gold_score(p["prompt"], p["chosen"]) > gold_score(p["prompt"], p["rejected"]) for p in pairs
        )

    assert 0.87 < agreement(data["prefs_train"]) < 0.93  # 10% flipped
    assert agreement(data["prefs_test"]) == 1.0  # held-out labels are clean


def test_demonstrations_are_mediocre():
    demos = toy_datasets(0, {"sft_train": 1000})["sft_train"]
    mean_gold = statistics.mean(gold_score(d["prompt"], d["response"]) for d in demos)
    assert 1.3 < mean_gold < 2.0  # well below a perfect 2.7: room for RL


# --------------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------------


def test_tokenizer_round_trips_the_task_text(bpe):
    tok = policy_tokenizer(bpe)
    for text in task.tokenizer_corpus(0)[::7] + ["sure! sure! sure! 1 2 3.", "unseen words: zebra ±"]:
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    response_words = [*task.FRUITS, *task.NOT_FRUITS, *task.WORDS, *task.NICE, *task.DULL, *task.MEAN, "sure"]
    assert all(len(tok(" " + word, add_special_tokens=False)["input_ids"]) == 1 for word in response_words)
    assert len(tok) < 1024


def test_policy_chat_template(bpe):
    tok = policy_tokenizer(bpe)
    prompt = [{"role": "user", "content": "count to 3"}]
    query = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    full = tok.apply_chat_template(prompt + [{"role": "assistant", "content": "1 2 3."}], tokenize=False)
    assert query == "<|user|>count to 3<|assistant|>" and full == query + "1 2 3.<eos>"
    assert tok.pad_token_id != tok.eos_token_id and tok.padding_side == "left" and tok.bos_token is None
    with pytest.raises(Exception, match="unknown chat role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_reward_tokenizer_shares_ids_but_not_the_template(bpe):
    policy, reward = policy_tokenizer(bpe), reward_tokenizer(bpe)
    conversation = [{"role": "user", "content": "count to 3"}, {"role": "assistant", "content": "1 2 3."}]
    ids = reward.apply_chat_template(conversation)["input_ids"]
    assert ids[0] == reward.bos_token_id and ids[-1] == reward.eos_token_id
    assert ids != policy.apply_chat_template(conversation)["input_ids"]
    assert policy.get_vocab() == reward.get_vocab()  # a value model can start from the reward model
    assert reward.padding_side == "right" and reward.pad_token_id != reward.eos_token_id


def test_tokenizers_save_and_load_with_their_templates(bpe, tmp_path):
    for make in (policy_tokenizer, reward_tokenizer):
        tok = make(bpe)
        tok.save_pretrained(tmp_path / make.__name__)
        loaded = AutoTokenizer.from_pretrained(tmp_path / make.__name__)
        messages = [{"role": "user", "content": "name 2 fruits"}]
        assert loaded.apply_chat_template(messages, add_generation_prompt=True) == tok.apply_chat_template(
            messages, add_generation_prompt=True
        )
        assert (loaded.pad_token_id, loaded.eos_token_id, loaded.padding_side) == (
            tok.pad_token_id,
            tok.eos_token_id,
            tok.padding_side,
        )


# --------------------------------------------------------------------------------------------------
# Models and the world directory
# --------------------------------------------------------------------------------------------------


def test_models_are_deterministic_from_the_seed_and_leave_the_global_rng_alone(bpe):
    tok = policy_tokenizer(bpe)
    torch.manual_seed(123)
    expected = torch.rand(1)
    torch.manual_seed(123)
    a, b, c = build_policy(tok, seed=0), build_policy(tok, seed=0), build_policy(tok, seed=1)
    assert torch.rand(1) == expected
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    assert a.lm_head.weight is a.model.embed_tokens.weight  # tied
    assert sum(p.numel() for p in a.parameters()) < 1_000_000


def test_reward_model_starts_from_the_policy_transformer(bpe):
    policy = build_policy(policy_tokenizer(bpe), seed=0)
    reward = reward_model_from_policy(policy, reward_tokenizer(bpe), seed=0)
    assert torch.equal(reward.model.layers[0].mlp.up_proj.weight, policy.model.layers[0].mlp.up_proj.weight)
    assert reward.model.layers[0].mlp.up_proj.weight is not policy.model.layers[0].mlp.up_proj.weight
    assert reward.config.num_labels == 1 and reward.config.bos_token_id == reward_tokenizer(bpe).bos_token_id
    with pytest.raises(LmppoError, match="share the vocabulary"):
        reward_model_from_policy(policy, reward_tokenizer(train_bpe(["tiny corpus"], vocab_size=300)), seed=0)


def test_build_toy_world_writes_loadable_models_and_data(tmp_path):
    world = build_toy_world(tmp_path, seed=0, sizes=SMALL)
    policy = AutoModelForCausalLM.from_pretrained(world.policy_dir)
    tok = AutoTokenizer.from_pretrained(world.policy_dir)
    assert AutoTokenizer.from_pretrained(world.reward_tokenizer_dir).bos_token == "<bos>"
    assert (policy.config.pad_token_id, policy.config.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)
    lines = world.data["prefs_test"].read_text().splitlines()
    assert len(lines) == SMALL["prefs_test"] and set(json.loads(lines[0])) >= {"prompt", "chosen", "rejected"}
    query = tok.apply_chat_template(
        [{"role": "user", "content": "count to 3"}], add_generation_prompt=True, return_tensors="pt"
    )
    out = policy.generate(**query, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert query["input_ids"].shape[1] < out.shape[1] <= query["input_ids"].shape[1] + 4
