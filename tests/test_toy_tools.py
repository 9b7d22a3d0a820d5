"""The toy tools task: its judge, its reward, its calculator and its demonstrated episodes."""

import random

import pytest

from lmppo.errors import LmppoError
from lmppo.inputs.data import encode_context, render_chat
from lmppo.toy import tools
from lmppo.toy.tokenizer import tools_tokenizer


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_the_gold_judge_and_the_reward_read_the_sum_from_every_phrasing():
    for kind, phrasings in tools.PHRASINGS.items():
        for phrasing in phrasings:
            task = tools.sum_of(user(phrasing.format(a=61, b=19, c=5)))
            assert task.kind == kind and task.numbers == (61, 19, 5)[: len(task.numbers)]
    prompt = user("take 19 from 61")
    assert tools.gold_score(prompt, "61 minus 19 is 42.") == tools.PERFECT_GOLD
    assert tools.gold_score(prompt, "42.") == 2.0  # right, but not said as a sentence
    assert tools.gold_score(prompt, "61 minus 19 is 42") == 2.0  # no period
    assert tools.gold_score(prompt, "61 minus 19 is 41.") == 0.0
    calling = tools.call_text("subtract", 61, 42)  # still calling: no answer, whatever its last number
    assert tools.gold_score(prompt, calling) == -0.5
    assert tools.answer_reward([prompt] * 3, ["so 42.", "42 or 43.", calling]) == [1.0, 0.0, 0.0]
    with pytest.raises(LmppoError, match="not one of its prompts"):
        tools.gold_score(user("count to 3"), "1 2 3.")


def test_the_calculator_answers_calls_and_charges_each_failed_one():
    calculator = tools.Calculator()
    calculator.reset({}, seed=0)
    step = calculator.step(tools.call_text("add", 17, 25))
    assert [m["content"] for m in step.messages] == ["42"] and step.reward == 0.0 and not step.done
    bad = '<tool_call>{"name": "add", "arguments": {"a": true, "b": 2}}</tool_call>'
    step = calculator.step(tools.call_text("add", 1, 2, broken=True) + bad)
    assert step.tool_calls == 2 and step.tool_failures == 2
    assert step.reward == pytest.approx(-2 * tools.FAILED_CALL_COST)
    assert all(m["content"].startswith("error:") for m in step.messages)
    assert calculator.step("42.").done  # no call: the final answer


def test_demonstrated_episodes_hold_what_the_calculator_answers():
    rng = random.Random(0)
    for task in tools.sample_sums(60, seed=0, split="train", stream="test"):
        perfect = tools.episode(task, rng, "good")
        assert tools.gold_score(perfect[:1], perfect[-1]["content"]) == tools.PERFECT_GOLD
        assert len(perfect) == 2 + 2 * (len(task.numbers) - 1)  # one call per operation, then the answer
        for quality in ("mediocre", "bad"):
            messages = tools.episode(task, rng, quality)
            calculator = tools.Calculator()
            for call, result in zip(messages[1:-1:2], messages[2:-1:2]):
                assert [m["content"] for m in calculator.step(call["content"]).messages] == [
                    result["content"]
                ]


def test_held_out_sums_appear_in_no_training_data():
    train = {(t.kind, t.numbers) for t in tools.sample_sums(2000, seed=0, split="train", stream="demos")}
    test = {(t.kind, t.numbers) for t in tools.sample_sums(300, seed=0, split="test", stream="prompts")}
    assert train and test and not train & test


def test_the_tools_tokenizer_renders_an_episode_turn_by_turn():
    """The tool role renders, a call's markers are text the environment reads, and an episode's context is
    the template's difference (the check lmppo.inputs.data.encode_context makes)."""
    tokenizer = tools_tokenizer(tools.tools_corpus(0))
    call = tools.call_text("add", 17, 25)
    ids = tokenizer(call, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == call
    assert tokenizer.convert_ids_to_tokens(ids)[0] == "<tool_call>"  # one token, not eight
    history = user("what is 17 plus 25?")
    context = encode_context(
        tokenizer, None, history, call, "<eos>", [{"role": "tool", "content": "42"}], more_turns=True
    )
    assert tokenizer.decode(context) == "<|tool|>42<|assistant|>"
    whole = [*history, {"role": "assistant", "content": call}, {"role": "tool", "content": "42"}]
    assert render_chat(tokenizer, whole, None, add_generation_prompt=True).endswith(
        "</tool_call><eos><|tool|>42<|assistant|>"
    )
