"""SmolLM2 with a calculator: arithmetic word problems, the tool, the reward and the judge.

A problem is one user message under a system message that describes the tool:

    user       Mia had 312 stickers and gave 148 of them to a friend. How many stickers does Mia have left?
    assistant  <tool_call>{"name": "calculator", "arguments": {"expression": "312 - 148"}}</tool_call>
    tool       164
    assistant  The answer is 164.

A 135M model does not do three-digit arithmetic in its head; it can learn to read the numbers and the
operation out of the story, write them as an expression, and copy the tool's result. Six kinds of problem:
add, sub, mul, div and two two-step ones (add then subtract, multiply then add) that fit one expression.

Used by the example's configs (paths relative to the repository root):
- ``rollout.environment: examples/smollm2_calculator/calculator.py:Calculator``: the tool; a failed call
  (bad JSON, an unknown tool, an expression it refuses) costs FAILED_CALL_COST as that turn's reward;
- ``reward.function: ...:reward``: 1 when the final message's last number is the answer;
- ``data.eval_judge: ...:correct``: the held-out judge, the same rule (the reward is the judge's own rule).

The SFT demonstrations come from an annotator who slips on a quarter of them (:data:`SLIPS`): answers
without the tool, types a number or the operation wrong, or copies the result wrong. SFT imitates the slips
along with the format; PPO, rewarded for the right number, has them to remove.
"""

from __future__ import annotations

import ast
import functools
import json
import operator
import random
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from lmppo.sampling.environments import Step, ToolEnvironment

SYSTEM = "You have a calculator tool. Use it, then answer: The answer is N."  # short: every token costs
NAMES = ("Mia", "Sam", "Ava", "Leo", "Noah", "Emma", "Omar", "Lina", "Ravi", "Zoe", "Ben", "Yuki")
ITEMS = ("apples", "stickers", "marbles", "pencils", "coins", "books", "cards", "shells", "beads", "stamps")
# kind -> (phrasings, the expression); the numbers a, b, c come from NUMBERS
PROBLEMS = {
    "add": (
        (
            "{name} has {a} {items}. {name} gets {b} more. How many {items} does {name} have now?",
            "A box holds {a} {items} and another holds {b}. How many {items} are there in both boxes?",
        ),
        "{a} + {b}",
    ),
    "sub": (
        (
            "{name} had {a} {items} and gave {b} of them to a friend. How many {items} does {name} have left?",
            "There were {a} {items} on a shelf. {name} took {b}. How many {items} are still on the shelf?",
        ),
        "{a} - {b}",
    ),
    "mul": (
        (
            "A shop packs {items} in boxes of {b}. How many {items} are in {a} boxes?",
            "{name} buys {a} bags with {b} {items} in each bag. How many {items} does {name} buy?",
        ),
        "{a} * {b}",
    ),
    "div": (
        (
            "{name} shares {a} {items} equally among {b} friends. How many {items} does each friend get?",
            "{a} {items} are packed into {b} equal boxes. How many {items} are in each box?",
        ),
        "{a} / {b}",
    ),
    "add_sub": (
        (
            "{name} had {a} {items}, found {b} more and then lost {c}. How many {items} does {name} have now?",
            "A club had {a} {items}. It bought {b} more and gave away {c}. How many {items} does it have?",
        ),
        "{a} + {b} - {c}",
    ),
    "mul_add": (
        (
            "{name} buys {a} packs of {b} {items} and already has {c}. How many {items} does {name} have?",
            "There are {a} rows of {b} {items} and {c} more on the side. How many {items} are there?",
        ),
        "{a} * {b} + {c}",
    ),
}
FAILED_CALL_COST = 0.2
SIZES = {"sft_train": 600, "sft_test": 60, "prompts_train": 600, "prompts_test": 150}
SLIPS = {"none": 0.75, "guess": 0.1, "wrong_expression": 0.08, "copy": 0.07}


@dataclass(frozen=True)
class Problem:
    kind: str
    text: str  # the user message
    expression: str  # what a careful solver types into the calculator

    @property
    def answer(self) -> int:
        return int(evaluate(self.expression))

    @property
    def prompt(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": self.text}]


def _numbers(kind: str, rng: random.Random) -> dict[str, int]:
    if kind == "add":
        return {"a": rng.randint(100, 999), "b": rng.randint(100, 999)}
    if kind == "sub":
        a = rng.randint(200, 999)
        return {"a": a, "b": rng.randint(100, a - 50)}
    if kind == "mul":
        return {"a": rng.randint(3, 19), "b": rng.randint(12, 99)}
    if kind == "div":
        b = rng.randint(3, 12)
        return {"a": b * rng.randint(12, 99), "b": b}
    if kind == "add_sub":
        a, b = rng.randint(100, 500), rng.randint(20, 99)
        return {"a": a, "b": b, "c": rng.randint(10, a)}
    return {"a": rng.randint(3, 12), "b": rng.randint(6, 24), "c": rng.randint(10, 99)}


def problems(split: str, n: int, stream: str) -> list[Problem]:
    """``n`` problems of one split ("train" or "test"), kinds in turn; a split's numbers never repeat in the
    other (the split is decided by the numbers, whatever the phrasing)."""
    rng, out = random.Random(f"{split}-{stream}"), []
    while len(out) < n:
        kind = tuple(PROBLEMS)[len(out) % len(PROBLEMS)]
        numbers = _numbers(kind, rng)
        in_test = random.Random(f"split-{kind}-{sorted(numbers.items())}").random() < 0.2
        if in_test != (split == "test"):
            continue
        phrasings, expression = PROBLEMS[kind]
        words = {"name": rng.choice(NAMES), "items": rng.choice(ITEMS), **numbers}
        out.append(Problem(kind, rng.choice(phrasings).format(**words), expression.format(**numbers)))
    return out


@functools.cache
def _by_text() -> dict[str, Problem]:
    return {
        p.text: p
        for name, n in SIZES.items()
        for p in problems(name.split("_")[1], n, stream=name.split("_")[0])
    }


def problem_of(prompt: str | list[dict]) -> Problem:
    """The problem a prompt (its messages, or the user's text) asks."""
    text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    if text not in _by_text():
        raise ValueError(f"not one of this example's problems: {text!r}")
    return _by_text()[text]


# --------------------------------------------------------------------------------------------------
# The tool
# --------------------------------------------------------------------------------------------------

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate(expression: str) -> float:
    """+, -, *, / and brackets over numbers; anything else is refused (never ``eval``)."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"the calculator takes numbers with + - * / and brackets, not {ast.dump(node)[:40]}")

    if not isinstance(expression, str) or len(expression) > 100:
        raise ValueError("the expression must be a string of at most 100 characters")
    return value(ast.parse(expression, mode="eval").body)


def calculator(expression: str) -> str:
    result = evaluate(expression)
    return str(int(result)) if float(result).is_integer() else f"{result:.4f}".rstrip("0")


class Calculator(ToolEnvironment):
    """The environment: one tool, ``calculator(expression)``; each failed call costs FAILED_CALL_COST."""

    tools: ClassVar = {"calculator": calculator}

    def step(self, text: str) -> Step:
        step = super().step(text)
        step.reward = -FAILED_CALL_COST * step.tool_failures
        return step


# --------------------------------------------------------------------------------------------------
# The reward and the judge
# --------------------------------------------------------------------------------------------------

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def final_number(response: str) -> float | None:
    """The number a final message answers with (its last), or None: none, or still calling the tool."""
    if "<tool_call>" in response:
        return None
    numbers = _NUMBER.findall(response.replace(",", ""))
    return float(numbers[-1]) if numbers else None


def correct(prompt: Any, response: str) -> float:
    """The held-out judge (``data.eval_judge``): 1.0 when the final answer is right."""
    return float(final_number(response) == problem_of(prompt).answer)


def reward(prompts: list, responses: list[str]) -> list[float]:
    """The training reward (``reward.function``): the judge's own rule, per episode's final message."""
    return [correct(p, r) for p, r in zip(prompts, responses)]


# --------------------------------------------------------------------------------------------------
# Demonstrations
# --------------------------------------------------------------------------------------------------


def call_text(expression: str) -> str:
    return (
        "<tool_call>"
        + json.dumps({"name": "calculator", "arguments": {"expression": expression}})
        + "</tool_call>"
    )


def _off(n: int, rng: random.Random) -> int:
    return n + rng.choice((-10, -2, -1, 1, 2, 10, 100))


def _wrong(expression: str, rng: random.Random) -> str:
    """The expression with one number typed wrong or the first operator swapped."""
    numbers = re.findall(r"\d+", expression)
    if rng.random() < 0.5:
        k = rng.randrange(len(numbers))
        numbers[k] = str(max(1, _off(int(numbers[k]), rng)))
        return re.sub(r"\d+", lambda m, it=iter(numbers): next(it), expression)
    swap = {"+": "-", "-": "+", "*": "+", "/": "*"}
    return re.sub(r"[-+*/]", lambda m: swap[m.group()], expression, count=1)


def episode(problem: Problem, slip: str, rng: random.Random) -> list[dict[str, str]]:
    """A demonstrated episode with the annotator's ``slip`` (a key of SLIPS); the tool's answer is what
    :class:`Calculator` answers to the call."""
    messages = problem.prompt
    if slip == "guess":
        return [*messages, {"role": "assistant", "content": f"The answer is {_off(problem.answer, rng)}."}]
    expression = _wrong(problem.expression, rng) if slip == "wrong_expression" else problem.expression
    result, _ = Calculator().call(json.dumps({"name": "calculator", "arguments": {"expression": expression}}))
    final = str(_off(int(float(result)), rng)) if slip == "copy" else result
    return [
        *messages,
        {"role": "assistant", "content": call_text(expression)},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": f"The answer is {final}."},
    ]


def datasets() -> dict[str, list[dict]]:
    """The example's JSONL files: sft_{train,test} ({"messages"} episodes), prompts_{train,test}."""
    rng, out = random.Random("demos"), {}
    for name, n in SIZES.items():
        rows = problems(name.split("_")[1], n, stream=name.split("_")[0])
        if name.startswith("sft"):
            slips = rng.choices(tuple(SLIPS), weights=tuple(SLIPS.values()), k=n)
            out[name] = [{"messages": episode(p, s, rng), "kind": p.kind} for p, s in zip(rows, slips)]
        else:
            out[name] = [{"prompt": p.prompt, "kind": p.kind} for p in rows]
    return out
