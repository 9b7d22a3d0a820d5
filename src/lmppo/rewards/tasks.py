"""Rewards of tasks users already have: reasoning-gym's own answer checks, and math-verify's.

Both need a column of the prompt row (the reasoning-gym ``entry``, the gold ``answer``). lmppo calls a
reward function with the prompts and responses only; an environment resets on the whole row. So each reward
here is a one-turn environment (``rollout.environment``, docs/multiturn.md): it keeps its row's column on
``reset`` and scores the response at its one ``step``, done; its turn reward is then the run's reward.

The episodes' runner steps environments on worker threads, where math-verify's own timeouts (SIGALRM, the
main thread's only) raise: it runs without them here, and ``rollout.environment_timeout_s`` bounds a step.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

from lmppo.errors import LmppoError
from lmppo.inputs.tasks import require
from lmppo.sampling.environments import Step


def reasoning_gym_score(entry: dict[str, Any], text: str) -> float:
    """``text`` scored by the entry's task's own ``score_answer`` on the answer in its last
    ``<answer>...</answer>`` (reasoning-gym's ``extract_answer``; none scores as the task scores None)."""
    utils = require("reasoning_gym.utils", "the reasoning-gym reward")
    check = _score_answer(entry["metadata"]["source_dataset"])
    answer = utils.extract_answer(text)
    # JSON made the entry's tuples lists (arc_agi compares a board to a tuple): both readings are the same
    # content, so the better score is the one the task gave the entry it made
    return max(_checked(check, answer, reading) for reading in (entry, _tuples(entry)))


def _checked(check, answer: str | None, entry: dict[str, Any]) -> float:
    try:
        return float(check(answer, entry))
    except Exception:  # a task whose check raises on an answer it cannot read (prime_factorization's int())
        return 0.0


def _tuples(value: Any) -> Any:
    """``value`` with every list a tuple, inside dicts too."""
    if isinstance(value, dict):
        return {key: _tuples(item) for key, item in value.items()}
    if isinstance(value, list):
        return tuple(_tuples(item) for item in value)
    return value


@functools.cache
def _score_answer(task: str):
    """The task's ``score_answer`` (a dataset of its default config: made once per task and process)."""
    return require("reasoning_gym", "the reasoning-gym reward").get_score_answer_fn(task)


def math_verify_score(gold: Any, text: str) -> float:
    """1.0 when math-verify finds ``text``'s final answer (boxed, LaTeX or a plain number) equal to ``gold``
    (LaTeX or a number), else 0.0. No SIGALRM timeouts: safe on any thread."""
    verify = require("math_verify", "the math-verify reward")
    parsed_gold = verify.parse(_as_latex(gold), parsing_timeout=None)
    if not parsed_gold:
        raise LmppoError(
            f"math-verify cannot read the gold answer {gold!r}; give the answer column a number or a LaTeX "
            "expression (e.g. 42, \\frac{1}{2}, \\boxed{x^2})"
        )
    answer = verify.parse(text, parsing_timeout=None)
    return float(verify.verify(parsed_gold, answer, timeout_seconds=None))


def _as_latex(gold: Any) -> str:
    """A gold answer in math delimiters, which math-verify's LaTeX extraction needs (unless already there)."""
    text = str(gold).strip()
    return text if "$" in text or "\\boxed" in text else f"${text}$"


def _column(row: dict[str, Any], key: str, environment: str, made_by: str) -> Any:
    if key not in row:
        raise LmppoError(
            f"rollout.environment {environment} scores against each prompt row's {key!r} column, and a row has "
            f"only {sorted(row)}: {made_by}"
        )
    return row[key]


class ReasoningGym:
    """One turn scored by its task's ``score_answer`` against the row's ``entry`` (rows of
    ``lmppo data reasoning-gym``)."""

    def reset(self, row: dict[str, Any], seed: int) -> None:
        made_by = "make the prompts with `lmppo data reasoning-gym TASK --out FILE`"
        self.entry = _column(row, "entry", "lmppo.rewards.tasks:ReasoningGym", made_by)

    def step(self, text: str) -> Step:
        return Step(reward=reasoning_gym_score(self.entry, text), done=True)


class MathVerify:
    """One turn scored 1.0 when math-verify finds its answer equal to the row's ``answer`` column, else 0.0;
    subclass it with another ``answer_key`` for another column."""

    answer_key: ClassVar[str] = "answer"

    def reset(self, row: dict[str, Any], seed: int) -> None:
        made_by = "give each row one, or subclass MathVerify with answer_key naming the column that holds it"
        self.gold = _column(row, self.answer_key, "lmppo.rewards.tasks:MathVerify", made_by)

    def step(self, text: str) -> Step:
        return Step(reward=math_verify_score(self.gold, text), done=True)
