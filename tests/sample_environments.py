"""Environments the tests train and sample with, importable by path (``sample_environments.py:AnswerTwice``)
from a subprocess as from the tests themselves."""

import asyncio
import random
import threading
import time
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


WORDS = ("good", "bad", "cat", "dog", "sun", "rain", "tree", "bird")
LATENCY = random.SystemRandom()  # not the run's seed: how long a call takes varies from run to run


class Jittery:
    """Turns, words and rewards drawn from the episode's seed, each call taking a random time (0-30 ms)
    drawn from the system's entropy: a concurrent run's calls finish in a different order every time."""

    def reset(self, row, seed):
        time.sleep(LATENCY.uniform(0.0, 0.03))
        self.start(seed)

    def step(self, text):
        time.sleep(LATENCY.uniform(0.0, 0.03))
        return self.answer()

    def start(self, seed):
        self.rng, self.turn = random.Random(seed), 0
        self.turns = self.rng.randint(1, 3)

    def answer(self) -> Step:
        self.turn += 1
        reward = round(self.rng.random(), 3)
        if self.turn >= self.turns:
            return Step(reward=reward, done=True)
        words = " ".join(self.rng.choices(WORDS, k=self.rng.randint(1, 4)))
        return Step(messages=[{"role": "user", "content": words}], reward=reward)


class AsyncJittery(Jittery):
    """:class:`Jittery` with coroutine methods, sleeping on the event loop."""

    async def reset(self, row, seed):
        await asyncio.sleep(LATENCY.uniform(0.0, 0.03))
        self.start(seed)

    async def step(self, text):
        await asyncio.sleep(LATENCY.uniform(0.0, 0.03))
        return self.answer()


RELEASE = threading.Event()  # set by a test when done: lets the calls left hanging below return


class HangsOnPoems:
    """Answers like :class:`AnswerTwice`, except that a step on a row whose prompt mentions a poem hangs
    (until :data:`RELEASE`), and so does the reset of one about the night. Counts its calls after a hang."""

    calls_after_hanging = 0

    def reset(self, row, seed):
        self.hung, self.turn, self.prompt = False, 0, row["prompt"]
        if "night" in self.prompt:
            RELEASE.wait()

    def step(self, text):
        if self.hung:
            HangsOnPoems.calls_after_hanging += 1
        self.turn += 1
        if "poem" in self.prompt:
            self.hung = True
            RELEASE.wait()
        return Step(messages=[{"role": "user", "content": "tell me more"}], reward=0.1, done=self.turn >= 2)


class AsyncHangsOnPoems(HangsOnPoems):
    """:class:`HangsOnPoems` awaiting forever instead, on the event loop."""

    async def reset(self, row, seed):
        self.hung, self.turn, self.prompt = False, 0, row["prompt"]

    async def step(self, text):
        self.turn += 1
        if "poem" in self.prompt:
            await asyncio.Event().wait()
        return Step(messages=[{"role": "user", "content": "tell me more"}], reward=0.1, done=self.turn >= 2)


class Sleeps:
    """Each step takes ``latency`` seconds and answers; done after ``turns`` steps."""

    latency, turns = 0.1, 2

    def reset(self, row, seed):
        self.turn = 0

    def step(self, text):
        time.sleep(self.latency)
        self.turn += 1
        return Step(messages=[{"role": "user", "content": "tell me more"}], done=self.turn >= self.turns)
