"""A small text environment on OpenEnv's server API, for tests/test_openenv.py: the user thinks of a word
(the prompt row's ``word``) and the policy guesses it. ``python openenv_server.py PORT MAX_SESSIONS`` serves
it on 127.0.0.1, with ``GET /sessions`` the number open; ``openenv:.../openenv_server.py:Guess`` plays it
in-process."""

from __future__ import annotations

import sys
from typing import ClassVar

if __name__ == "__main__":  # no web UI is served: without gradio's import the server starts in 2 s, not 6
    sys.modules["gradio"] = None

from openenv.core.env_server import Action, Environment, Observation, State, create_app


class Say(Action):
    text: str


class Reply(Observation):
    message: str = ""


class Guess(Environment):
    """A guess that holds the word ends the episode with a reward of 1; another is answered with a hint that
    tells the seed and the turn (what the tests check reached the server)."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    live: ClassVar[set[int]] = set()  # the instances not closed yet: one per open session

    def __init__(self) -> None:
        super().__init__()
        self.live.add(id(self))

    def close(self) -> None:
        self.live.discard(id(self))

    def reset(self, seed: int | None = None, episode_id: str | None = None, word: str = "good") -> Reply:
        self.word, self.seed, self.turn = word, seed, 0
        return Reply(message="guess my word")

    def step(self, action: Say) -> Reply:
        self.turn += 1
        if self.word in action.text:
            return Reply(message="yes", reward=1.0, done=True)
        return Reply(message=f"no (seed {self.seed}, turn {self.turn})", reward=0.0)

    @property
    def state(self) -> State:
        return State(step_count=self.turn)


class Move(Action):
    word: str
    note: str  # a second string field: lmppo cannot tell where the policy's text goes


class GuessWithNotes(Guess):
    def step(self, action: Move) -> Reply:
        return super().step(Say(text=action.word))


def serve(port: int, max_sessions: int) -> None:
    import uvicorn

    app = create_app(Guess, Say, Reply, max_concurrent_envs=max_sessions)
    app.get("/sessions")(lambda: len(Guess.live))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
