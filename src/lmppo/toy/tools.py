"""The toy tools task (``lmppo quickstart --task tools``): sums the policy cannot do, a calculator it can
call, a programmatic reward and a hidden gold judge.

Three kinds of prompt, each a single user message; the answer needs the calculator, which only the
environment has (a 2-layer model does not add two-digit numbers):

    add   "what is 17 plus 25?"        -> add(17, 25) -> 42                  -> "17 plus 25 is 42."
    sub   "what is 61 minus 19?"       -> subtract(61, 19) -> 42             -> "61 minus 19 is 42."
    sum3  "what is 5 plus 9 plus 12?"  -> add(5, 9) -> 14, add(14, 12) -> 26 -> "5 plus 9 plus 12 is 26."

A call is ``<tool_call>{"name": "add", "arguments": {"a": 17, "b": 25}}</tool_call>`` (the format
:class:`lmppo.sampling.environments.ToolEnvironment` parses). So the policy must copy the numbers into a
well-formed call, read the result, maybe call again, and copy the result into its answer: credit for the
final answer has to reach the first turn across the tool's output, which is what the critic is for.

What training sees: :func:`answer_reward`, 1 when the final message's last number is right, and
:class:`Calculator`'s turn reward, -0.2 for each failed call. The gold judge (:func:`gold_score`) grades
like a careful human: the right number (2), said as a sentence that restates the sum (0.5), ending with a
period (else -0.5), and a message still calling a tool is no answer (-0.5). The annotator who writes the
SFT demonstrations slips (skips the tool and guesses, copies a number wrong, breaks the call's JSON), so
the SFT policy is mediocre on gold.
"""

from __future__ import annotations

import functools
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from lmppo.errors import LmppoError
from lmppo.sampling.environments import Step, ToolEnvironment
from lmppo.toy.task import _choose, as_user_text  # the annotator's weighted pick, shared

KINDS = ("add", "sub", "sum3")
PHRASINGS = {
    "add": ("what is {a} plus {b}?", "add {a} and {b}", "how much is {a} plus {b}?"),
    "sub": ("what is {a} minus {b}?", "take {b} from {a}", "how much is {a} minus {b}?"),
    "sum3": ("what is {a} plus {b} plus {c}?", "add {a}, {b} and {c}", "how much is {a} plus {b} plus {c}?"),
}
SAYS = {"add": "{a} plus {b}", "sub": "{a} minus {b}", "sum3": "{a} plus {b} plus {c}"}
PERFECT_GOLD = 2.5
FAILED_CALL_COST = 0.2
TEST_FRACTION = 0.2
_NUMBER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Sum:
    kind: str
    numbers: tuple[int, ...]
    text: str  # the user message

    @property
    def answer(self) -> int:
        first, *rest = self.numbers
        return first - rest[0] if self.kind == "sub" else sum(self.numbers)

    @property
    def sentence(self) -> str:
        """The perfect answer."""
        return SAYS[self.kind].format(**dict(zip("abc", self.numbers))) + f" is {self.answer}."


def _numbers(kind: str, rng: random.Random) -> tuple[int, ...]:
    if kind == "add":
        return rng.randint(1, 49), rng.randint(1, 49)
    if kind == "sub":
        a = rng.randint(10, 99)
        return a, rng.randint(1, a - 1)
    return rng.randint(1, 30), rng.randint(1, 30), rng.randint(1, 30)


def _is_test(kind: str, numbers: tuple[int, ...], seed: int) -> bool:
    """Held out by the numbers (any phrasing): a held-out sum appears in no training data."""
    return random.Random(f"{seed}-split-{kind}-{numbers}").random() < TEST_FRACTION


def sample_sums(n: int, *, seed: int, split: str, stream: str) -> list[Sum]:
    """``n`` sums of the ``split``, kinds equally often."""
    rng, sums = random.Random(f"{seed}-{stream}-{split}"), []
    while len(sums) < n:
        kind = rng.choice(KINDS)
        numbers = _numbers(kind, rng)
        if _is_test(kind, numbers, seed) == (split == "test"):
            text = rng.choice(PHRASINGS[kind]).format(**dict(zip("abc", numbers)))
            sums.append(Sum(kind, numbers, text))
    return sums


@functools.cache
def _patterns() -> list[tuple[str, re.Pattern]]:
    """Each phrasing as a regular expression that reads its numbers back by name ("take b from a")."""
    patterns = []
    for kind, phrasings in PHRASINGS.items():
        for phrasing in phrasings:
            pattern = re.escape(phrasing)
            for name in "abc":
                pattern = pattern.replace(re.escape(f"{{{name}}}"), f"(?P<{name}>\\d+)")
            patterns.append((kind, re.compile(pattern + "$")))
    return patterns


def sum_of(prompt: str | Sequence[dict]) -> Sum:
    """The sum a prompt asks for."""
    text = as_user_text(prompt)
    for kind, pattern in _patterns():
        if match := pattern.match(text):
            numbers = match.groupdict()
            return Sum(kind, tuple(int(numbers[name]) for name in sorted(numbers)), text)
    raise LmppoError(f"toy tools task: {text!r} is not one of its prompts; its judge grades only those")


# --------------------------------------------------------------------------------------------------
# The calculator, the reward and the gold judge
# --------------------------------------------------------------------------------------------------


def _integers(*values: Any) -> None:
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise TypeError(f"the calculator takes whole numbers, got {values}")


def add(a: int, b: int) -> int:
    _integers(a, b)
    return a + b


def subtract(a: int, b: int) -> int:
    _integers(a, b)
    return a - b


class Calculator(ToolEnvironment):
    """``rollout.environment: lmppo.toy.tools:Calculator``: add and subtract; each failed call costs
    FAILED_CALL_COST as that turn's reward."""

    tools: ClassVar = {"add": add, "subtract": subtract}

    def step(self, text: str) -> Step:
        step = super().step(text)
        step.reward = -FAILED_CALL_COST * step.tool_failures
        return step


def final_number(response: str) -> int | None:
    """The number a final message answers with (its last), or None: no number, or still calling a tool."""
    if "<tool_call>" in response:
        return None
    numbers = _NUMBER.findall(response)
    return int(numbers[-1]) if numbers else None


def answer_reward(prompts: Sequence, responses: Sequence[str]) -> list[float]:
    """The training reward, ``reward.function: lmppo.toy.tools:answer_reward``: 1 for the right number."""
    return [float(final_number(r) == sum_of(p).answer) for p, r in zip(prompts, responses)]


def gold_score(prompt: str | Sequence[dict], response: str) -> float:
    """A careful human's grade of the final message, from -1 to PERFECT_GOLD (2.5)."""
    task = sum_of(prompt)
    if "<tool_call>" in response:
        return -0.5  # the episode ran out while the policy was still calling
    text = response.strip()
    correct = 2.0 * (final_number(text) == task.answer)
    restated = 0.5 * (text.rstrip(".") == task.sentence.rstrip("."))
    return correct + restated - (0.0 if text.endswith(".") else 0.5)


# --------------------------------------------------------------------------------------------------
# A noisy annotator: demonstrated episodes
# --------------------------------------------------------------------------------------------------


def call_text(name: str, a: int, b: int, broken: bool = False) -> str:
    body = json.dumps({"name": name, "arguments": {"a": a, "b": b}})
    return f"<tool_call>{body[:-1] if broken else body}</tool_call>"


def _slip(n: int, rng: random.Random) -> int:
    return n + rng.choice((-2, -1, 1, 2, 10))


def episode(task: Sum, rng: random.Random, quality: str) -> list[dict[str, str]]:
    """A demonstrated episode, from the prompt to the final answer, of the given quality; each tool result is
    what :class:`Calculator` answers to the call."""
    slip = {"good": "none", "mediocre": rng.choice(SLIPS), "bad": rng.choice(FAILURES)}[quality]
    messages = [{"role": "user", "content": task.text}]
    if slip in ("guess", "refuse"):
        final = "i do not know." if slip == "refuse" else _say(task, _slip(task.answer, rng))
        return [*messages, {"role": "assistant", "content": final}]
    running, *rest = task.numbers
    name = "subtract" if task.kind == "sub" else "add"
    for k, b in enumerate(rest):
        if slip == "broken" and k == 0:
            messages += _turn(call_text(name, running, b, broken=True))
        if slip == "argument" and k == len(rest) - 1:
            b = _slip(b, rng)  # copied wrong into the call
        messages += _turn(call_text(name, running, b))
        running = int(messages[-1]["content"])
    answer = _slip(running, rng) if slip == "copy" else running
    final = _say(task, answer, period=slip != "no_period", restate=slip != "short")
    return [*messages, {"role": "assistant", "content": final}]


SLIPS = ("guess", "argument", "broken", "copy", "no_period", "short")
FAILURES = ("refuse", "guess", "copy")  # bad: no answer, a guess, a wrong copy
DEMO_QUALITY = {"good": 0.45, "mediocre": 0.4, "bad": 0.15}


def _turn(call: str) -> list[dict[str, str]]:
    """The policy's call and the calculator's answer."""
    answer, _ = Calculator().call(call.removeprefix("<tool_call>").removesuffix("</tool_call>"))
    return [{"role": "assistant", "content": call}, {"role": Calculator.result_role, "content": answer}]


def _say(task: Sum, answer: int, period: bool = True, restate: bool = True) -> str:
    says = SAYS[task.kind].format(**dict(zip("abc", task.numbers))) + " is " if restate else ""
    return f"{says}{answer}" + ("." if period else "")


# --------------------------------------------------------------------------------------------------
# Data sets
# --------------------------------------------------------------------------------------------------

DEFAULT_SIZES = {"sft_train": 2000, "sft_test": 200, "prompts_train": 512, "prompts_test": 128}


def demonstrations(n: int, *, seed: int, split: str) -> list[dict]:
    """Noisy SFT episodes: {"messages", "type"} (DEMO_QUALITY)."""
    rng = random.Random(f"{seed}-demos-{split}")
    return [
        {"messages": episode(task, rng, _choose(rng, DEMO_QUALITY)), "type": task.kind}
        for task in sample_sums(n, seed=seed, split=split, stream="demos")
    ]


def prompts(n: int, *, seed: int, split: str) -> list[dict]:
    """Prompts for PPO (train) or evaluation (test): {"prompt": messages, "type": kind}."""
    return [
        {"prompt": [{"role": "user", "content": task.text}], "type": task.kind}
        for task in sample_sums(n, seed=seed, split=split, stream="prompts")
    ]


def tools_datasets(seed: int, sizes: dict[str, int] | None = None) -> dict[str, list[dict]]:
    """Every data set of the tools world: sft_train/test (episodes), prompts_train/test."""
    sizes = {**DEFAULT_SIZES, **(sizes or {})}
    return {
        name: (demonstrations if name.startswith("sft") else prompts)(n, seed=seed, split=name.split("_")[1])
        for name, n in sizes.items()
    }


def tools_corpus(seed: int) -> list[str]:
    """Text to train the tools world's tokenizer on: episodes of every quality, every number."""
    rng = random.Random(f"{seed}-corpus")
    sums = sample_sums(3000, seed=seed, split="train", stream="corpus")
    sums += sample_sums(750, seed=seed, split="test", stream="corpus")
    texts = [m["content"] for task in sums for m in episode(task, rng, _choose(rng, DEMO_QUALITY))]
    return texts + [" ".join(map(str, range(-20, 200))), " ".join(f" {n}" for n in range(200))]
