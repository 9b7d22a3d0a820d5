"""The ready environments (lmppo.sampling.environments) and loading a user's."""

from __future__ import annotations

import pytest

from lmppo.errors import LmppoError
from lmppo.sampling.environments import SingleTurn, Step, ToolEnvironment, load_environment


class Calculator(ToolEnvironment):
    tools = {"add": lambda a, b: a + b, "lookup": lambda key: {"cat": "meow"}[key]}


def stepped(text: str) -> Step:
    environment = Calculator()
    environment.reset({"prompt": "p", "answer": 3}, seed=0)
    return environment.step(text)


def test_a_tool_call_is_answered_as_a_tool_message():
    step = stepped('I will add. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    assert step == Step(messages=[{"role": "tool", "content": "3"}], tool_calls=1)


def test_two_calls_in_one_turn_are_both_answered():
    step = stepped(
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'
        '<tool_call>{"name": "lookup", "arguments": {"key": "cat"}}</tool_call>'
    )
    assert [m["content"] for m in step.messages] == ["2", "meow"] and step.tool_calls == 2


@pytest.mark.parametrize(
    ("call", "error"),
    [
        ("<tool_call>add(1, 2)</tool_call>", "error: the call is not"),
        ('<tool_call>{"arguments": {}}</tool_call>', "error: the call is not"),
        ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "arguments must be an object"),
        ('<tool_call>{"name": "mul", "arguments": {}}</tool_call>', "error: no tool 'mul'; the tools are"),
        ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', "error: TypeError"),
        ('<tool_call>{"name": "lookup", "arguments": {"key": "dog"}}</tool_call>', "error: KeyError: 'dog'"),
    ],
)
def test_a_bad_call_is_an_observation_not_a_crash(call, error):
    step = stepped(call)
    assert not step.done and step.tool_calls == 1 and step.tool_failures == 1
    assert step.messages[0]["role"] == "tool" and error in step.messages[0]["content"]


def test_a_call_opened_and_never_closed_is_a_failed_call_not_the_end():
    step = stepped('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}')
    assert not step.done and step.tool_calls == 1 and step.tool_failures == 1
    assert step.messages == [
        {
            "role": "tool",
            "content": "error: a <tool_call> was opened and never closed; end each call with </tool_call>",
        }
    ]
    step = stepped('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> <tool_call>')
    assert [m["content"] for m in step.messages][0] == "3" and step.tool_failures == 1


def test_a_turn_without_a_call_ends_the_episode():
    assert stepped("The answer is 3.") == Step(done=True)


def test_single_turn_is_done_after_one_response():
    environment = SingleTurn()
    environment.reset({"prompt": "p"}, seed=1)
    assert environment.step("anything") == Step(done=True)


def test_an_environment_is_loaded_from_a_file_and_checked(tmp_path):
    (tmp_path / "envs.py").write_text(
        "class Good:\n    def reset(self, row, seed): pass\n    def step(self, text): pass\n"
        "def not_a_class(): pass\n"
    )
    assert load_environment(f"{tmp_path}/envs.py:Good").__name__ == "Good"
    assert load_environment("lmppo.sampling.environments:SingleTurn") is SingleTurn
    with pytest.raises(LmppoError, match=r"rollout.environment .*not_a_class.* is not a class with reset"):
        load_environment(f"{tmp_path}/envs.py:not_a_class")
    with pytest.raises(LmppoError, match=r"rollout.environment .*has no attribute 'Missing'"):
        load_environment(f"{tmp_path}/envs.py:Missing")


def test_a_misspelt_environment_class_gets_the_names_it_may_have_meant(tmp_path):
    (tmp_path / "my_env.py").write_text(
        "class GuessEnv:\n    def reset(self, row, seed): pass\n    def step(self, text): pass\n"
    )
    with pytest.raises(LmppoError, match=r"has no attribute 'GesEnv'; did you mean 'GuessEnv'\?") as err:
        load_environment(f"{tmp_path}/my_env.py:GesEnv")
    assert "did you mean" in str(err.value)
    with pytest.raises(LmppoError, match=r"'package\.module:Class' or 'path/to/file\.py:Class'"):
        load_environment("no_colon")
