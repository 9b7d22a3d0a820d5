"""SFT: response-only targets rendered as rollouts render prompts, and a loss that goes down."""

from __future__ import annotations

import json
import re
import statistics

import pytest
import torch
from helpers import role_tokenizer

from lmppo.errors import LmppoError
from lmppo.inputs.config import SupervisedConfig
from lmppo.inputs.data import encode_chat, load_demonstrations
from lmppo.math.core import token_logprobs
from lmppo.modeling.loading import load_causal_lm
from lmppo.sampling.hf_engine import hf_generator
from lmppo.toy.models import build_policy
from lmppo.toy.task import demonstrations, gold_score, tokenizer_corpus, toy_datasets
from lmppo.toy.tokenizer import policy_tokenizer, train_bpe
from lmppo.training.sft import IGNORE, response_nll, run_sft, sft_batch, sft_features, train_sft

EXAMPLES = [
    {"prompt": "count to 3", "response": "1 2 3."},
    {"prompt": [{"role": "user", "content": "name 2 fruits"}], "response": "sure! apple, kiwi."},
]


@pytest.fixture(scope="module")
def tok():
    return policy_tokenizer(train_bpe(tokenizer_corpus(0)))


def test_labels_are_ignored_exactly_on_query_and_padding(tok):
    batch = sft_batch(tok, EXAMPLES)
    for row, ex in enumerate(EXAMPLES):
        ids, labels = sft_features(tok, ex["prompt"], ex["response"])
        query_len = len(ids) - len(tok(ex["response"], add_special_tokens=False)["input_ids"]) - 1
        ignored = batch["labels"][row] == IGNORE
        expected = torch.zeros_like(ignored)
        expected[:query_len] = True  # the rendered prompt
        expected[len(ids) :] = True  # right padding
        assert torch.equal(ignored, expected)
        assert torch.equal(batch["labels"][row][~ignored], batch["input_ids"][row][~ignored])
        assert labels[-1] == tok.eos_token_id  # the response target ends with EOS
        assert batch["attention_mask"][row].sum() == len(ids)


def test_sft_sequence_is_the_rollout_query_plus_response(tok):
    """SFT trains on exactly the prompt ids a rollout generates from, and on the full chat rendering."""
    generator = hf_generator(build_policy(tok, seed=0), tok, max_new_tokens=8)
    for ex in EXAMPLES:
        ids, labels = sft_features(tok, ex["prompt"], ex["response"])
        query = generator.renderer.render(ex["prompt"])
        assert ids[: len(query)] == query and labels[len(query)] != IGNORE
        messages = (
            [{"role": "user", "content": ex["prompt"]}] if isinstance(ex["prompt"], str) else ex["prompt"]
        )
        conversation = messages + [{"role": "assistant", "content": ex["response"]}]
        assert ids == tok.apply_chat_template(conversation)["input_ids"]


EPISODE = [
    {"role": "user", "content": "tell me a story"},
    {"role": "assistant", "content": "the cat"},
    {"role": "tool", "content": "sun dog"},
    {"role": "assistant", "content": "a dog"},
    {"role": "user", "content": "two"},
    {"role": "assistant", "content": "it was happy"},
]


def test_a_demonstrated_episode_trains_on_the_assistant_turns_only():
    """Each assistant turn and its EOS is a target; the tool's output, the user's turn and the template's
    glue between turns are context; the ids are the whole conversation as the template renders it, as an
    episode played by the policy would be."""
    tok = role_tokenizer()
    ids, labels = sft_features(tok, EPISODE[:1], EPISODE[1:])
    assert ids == encode_chat(tok, EPISODE, None, add_generation_prompt=False)
    targets = tok.convert_ids_to_tokens([i for i, label in zip(ids, labels) if label != IGNORE])
    assert targets == ["the", "cat", "</s>", "a", "dog", "</s>", "it", "was", "happy", "</s>"]


def test_a_demonstrated_episode_is_read_from_its_messages(tmp_path):
    path = tmp_path / "episodes.jsonl"
    path.write_text(json.dumps({"messages": EPISODE}) + "\n" + json.dumps({"messages": EPISODE[:3]}) + "\n")
    with pytest.raises(LmppoError, match="line 2: a demonstrated episode's messages start with the prompt"):
        load_demonstrations(path)
    path.write_text(json.dumps({"messages": EPISODE}) + "\n")
    assert load_demonstrations(path) == [(EPISODE[:1], EPISODE[1:])]


def test_loss_is_the_mean_nll_of_response_tokens_only(tok):
    model = build_policy(tok, seed=0, hidden_size=32)
    batch = sft_batch(tok, EXAMPLES)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:]
    logp = token_logprobs(logits[:, :-1], targets.clamp(min=0))
    manual = -logp[targets != IGNORE].mean()
    assert torch.allclose(model(**batch).loss, manual, atol=1e-5)
    assert response_nll(model, tok, EXAMPLES) == pytest.approx(manual.item(), abs=1e-5)


def test_train_sft_lowers_the_loss(tok):
    data = toy_datasets(0, {"sft_train": 128, "sft_test": 32})
    model = build_policy(tok, seed=0, hidden_size=32)
    before = response_nll(model, tok, data["sft_test"])
    stats = train_sft(model, tok, data["sft_train"], epochs=8, lr=2e-2, batch_size=32, seed=0)
    assert stats["steps"] == 32 and stats["tokens"] > 0 and not model.training
    assert statistics.mean(stats["loss"][-4:]) < 0.5 * stats["loss"][0]
    assert response_nll(model, tok, data["sft_test"]) < 0.5 * before


def test_eos_stays_a_target_when_pad_is_eos(tok):
    """Masking labels by pad id (a common collator shortcut) would drop the EOS target here."""
    pad_is_eos = policy_tokenizer(train_bpe(tokenizer_corpus(0)))
    pad_is_eos.pad_token = pad_is_eos.eos_token
    batch = sft_batch(pad_is_eos, EXAMPLES)
    for row in range(len(EXAMPLES)):
        real = batch["attention_mask"][row].bool()
        assert batch["labels"][row][real][-1] == pad_is_eos.eos_token_id
        assert (batch["labels"][row][~real] == IGNORE).all()


def test_train_sft_refuses_empty_data(tok):
    with pytest.raises(LmppoError, match="no demonstrations"):
        train_sft(build_policy(tok, seed=0, hidden_size=32), tok, [], epochs=1, lr=1e-3, batch_size=2, seed=0)


def test_lora_sft_saves_a_merged_causal_lm_with_a_lower_loss(tok, tmp_path):
    base = build_policy(tok, seed=0, hidden_size=32)
    base.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    data = demonstrations(64, seed=0, split="train")
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(row) + "\n" for row in data))
    cfg = SupervisedConfig(
        model={"path": str(tmp_path / "base")},
        data=str(tmp_path / "sft.jsonl"),
        eval_data=str(tmp_path / "sft.jsonl"),
        output_dir=str(tmp_path / "sft"),
        epochs=4,
        lr=2e-2,
        batch_size=16,
        lora={"enabled": True, "r": 4, "target_modules": "all-linear"},
    )
    stats = run_sft(cfg)

    out = tmp_path / "sft"
    assert not list(out.glob("adapter*"))  # merged: a plain transformers directory
    model = load_causal_lm(out)
    before, after = response_nll(base, tok, data), response_nll(model, tok, data)
    assert after < before and stats["eval_nll"] == pytest.approx(after, abs=1e-5)
    # every linear layer but the (tied) output layer got an adapter; nothing else was trained
    linears = [m for n, m in base.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    assert stats["trained_parameters"] == sum(4 * (m.in_features + m.out_features) for m in linears)
    for name, weight in model.state_dict().items():
        if not name.endswith("proj.weight"):
            assert torch.equal(weight, base.state_dict()[name]), name


@pytest.mark.slow
def test_sft_policy_learns_the_toy_task(tok):
    """The toy recipe: the SFT policy ends its answers and scores near the (mediocre) demonstrations on gold."""
    data = toy_datasets(0)
    model = build_policy(tok, seed=0)
    train_sft(model, tok, data["sft_train"], epochs=8, lr=2e-3, batch_size=32, seed=0)
    prompts = [row["prompt"] for row in data["prompts_test"]]
    torch.manual_seed(0)
    rollout = hf_generator(model, tok, max_new_tokens=24).generate(prompts, policy_version=0)
    gold = statistics.mean(gold_score(p, r) for p, r in zip(prompts, rollout.response_texts))
    demo_gold = statistics.mean(gold_score(d["prompt"], d["response"]) for d in data["sft_test"])
    assert rollout.terminated.float().mean() > 0.95
    assert demo_gold - 0.4 < gold < 2.5


def test_sft_prints_progress_lines_when_stdout_is_no_terminal(tok, capsys):
    """A long SFT redirected to a file shows its batches, loss and ETA (quickstart opens no display)."""
    train_sft(
        build_policy(tok, seed=0, hidden_size=32), tok, EXAMPLES * 4, epochs=2, lr=1e-3, batch_size=2, seed=0
    )
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("SFT: batch")]
    assert [line.split("  ")[0] for line in lines] == [f"SFT: batch {k}/8" for k in range(1, 9)]
    assert all(re.search(r"  loss \d\S*  \S+ elapsed  ETA \S+$", line) for line in lines)
