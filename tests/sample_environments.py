"""Environments the tests train and sample with, importable by path (``sample_environments.py:AnswerTwice``)
from a subprocess as from the tests themselves."""

from pathlib import Path

from lmppo.sampling.environments import Step

SPEC = f"{Path(__file__).resolve()}:AnswerTwice"  # rollout.environment naming AnswerTwice by its file


class AnswerTwice:
    """Answers the first two turns with the user's next message, then ends the episode."""

    def reset(self, row, seed):
        self.turn = 0

    def step(self, text):
        self.turn += 1
        if self.turn < 3:
            return Step(messages=[{"role": "user", "content": "tell me more"}], reward=0.1)
        return Step(reward=1.0, done=True)
