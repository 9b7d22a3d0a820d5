"""textarena games as environments (``rollout.environment: textarena:GAME-ID``, docs/multiturn.md), on the
``textarena`` package (``pip install 'lmppo[textarena]'``).

Each episode is one game, made with ``textarena.make(GAME-ID)`` (its action wrappers kept: a move without
brackets is bracketed), the policy player 0. The other player(s) of a game of two (tried first) or one are an
**opponent**: a function ``(observation: str) -> str`` given everything the game has shown that player so
far and answering its move. The default, :func:`listed_move`, plays one of the moves the game's last
``Available Moves:`` (or ``Valid moves:``, ``Available actions:``) line lists, at random; another is
``textarena_environment(GAME-ID, opponent=my_function)`` in a file of your own, named as ``file.py:Class``.

The game's messages reach the policy as one user message per turn, each line ``[GAME] text`` or
``[Player 1] text`` (textarena's own format), the policy's own move left out (it is its turn). The first
observation is the prompt: ``lmppo data textarena GAME-ID`` writes rows holding it and the ``game_seed``
that makes it, and ``reset`` plays the same game (the row's prompt must hold that observation). A move the
game refuses is answered as the game rules (most give another try, then end the game, lost); the game's
reward for player 0 is the last turn's.

textarena's games draw from the global ``random`` module, which their reset seeds: each game draws from a
stream of its own (under a lock), so concurrent episodes never change each other's draws, and the opponent
draws from one seeded by the game's seed: an episode is a function of its row and the policy's moves.
"""

from __future__ import annotations

import random
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

from lmppo.errors import LmppoError
from lmppo.inputs.data import as_messages
from lmppo.sampling.environments import Step

POLICY = 0  # the policy's player id
GAME = -1  # textarena's sender id of the game's own messages (textarena.GAME_ID)
SEED_STRIDE = 100_000  # game seeds per --seed of `lmppo data textarena`: the most rows one file may hold
MOVES_LINE = re.compile(r"(?:available|valid) (?:moves|actions):(.*)", re.IGNORECASE)
_random_lock = threading.Lock()  # the global random module, lent to one game at a time


def textarena_environment(game_id: str, opponent: Callable[[str], str] | None = None) -> type[TextArenaGame]:
    """The environment class of ``rollout.environment: textarena:GAME-ID``; ``opponent`` plays the other
    players (default: :func:`listed_move`)."""
    ta = _textarena()
    if game_id not in ta.envs.registration.ENV_REGISTRY:
        raise LmppoError(
            f"rollout.environment textarena:{game_id}: textarena {_version()} has no game {game_id!r}; name "
            "one of textarena.envs.registration.ENV_REGISTRY, e.g. textarena:TicTacToe-v0"
        )
    attributes = {"game_id": game_id, "players": _players(game_id), "opponent": staticmethod(opponent)}
    return type(f"TextArena_{game_id}", (TextArenaGame,), attributes)


class TextArenaGame:
    """One textarena game per episode, the policy as player 0 (made by :func:`textarena_environment`)."""

    game_id: ClassVar[str]
    players: ClassVar[int]  # 1, or 2: the policy and an opponent
    opponent: ClassVar[Callable[[str], str] | None]

    def reset(self, row: dict[str, Any], seed: int) -> None:
        game_seed = _game_seed(row, self.game_id)
        first = self.start(game_seed)
        if first not in as_messages(row["prompt"])[-1]["content"]:
            raise LmppoError(
                f"rollout.environment textarena:{self.game_id}: the prompt row of game_seed {game_seed} does "
                f"not hold the game's first observation at that seed ({first[:120]!r}...), so the policy "
                f"would not see the game it plays. Make the prompt file with `lmppo data textarena "
                f"{self.game_id} --size N --seed S --out prompts.jsonl` (with this textarena, {_version()})"
            )

    def start(self, game_seed: int) -> str:
        """A new game at ``game_seed``, played up to the policy's first turn: what the policy sees then."""
        self._random = random.Random(game_seed).getstate()
        with self._game_random():  # a game may draw when it is made, too
            self.game = _textarena().make(self.game_id)
            self.game.reset(num_players=self.players, seed=game_seed)
        self.inner = _unwrapped(self.game)  # its get_observation: each player's new messages
        self.seen: dict[int, list[str]] = {}  # each opponent's messages so far
        self.play = (
            self.opponent if self.opponent is not None else _random_listed_move(random.Random(game_seed))
        )
        self.done = False
        self._opponents_move()
        return self._policy_view()

    def step(self, text: str) -> Step:
        with self._game_random():
            self.done, _ = self.game.step(text)
        self._opponents_move()
        if self.done:
            with self._game_random():
                rewards, _ = self.game.close()  # textarena 0.7: (rewards by player, game info)
            return Step(reward=float((rewards or {}).get(POLICY, 0.0)), done=True)
        return Step(messages=[{"role": "user", "content": self._policy_view()}])

    def _opponents_move(self) -> None:
        """The other players' moves until the game ends or the policy's turn comes (the opponent called
        outside the lock: it may be slow)."""
        while not self.done and self.inner.state.current_player_id != POLICY:
            with self._game_random():
                player, messages = self.inner.get_observation()
            self.seen.setdefault(player, []).extend(self._lines(messages))
            move = self.play("\n".join(self.seen[player]))
            with self._game_random():
                self.done, _ = self.game.step(move)

    def _policy_view(self) -> str:
        """The game's messages to the policy since its last turn, its own move left out."""
        with self._game_random():
            _, messages = self.inner.get_observation()
        return "\n".join(self._lines([m for m in messages if m[0] != POLICY]))

    def _lines(self, messages: list[tuple]) -> list[str]:
        """textarena's messages ``(sender, text, kind)`` as ``[GAME] text`` / ``[Player 1] text`` lines."""
        names = self.inner.state.role_mapping
        return [
            f"[{names.get(sender, 'GAME' if sender == GAME else f'Player {sender}')}] {text}"
            for sender, text, _ in messages
        ]

    @contextmanager
    def _game_random(self) -> Iterator[None]:
        """The global ``random`` holding this game's stream, under the lock, then the process's again."""
        with _random_lock:
            outside = random.getstate()
            random.setstate(self._random)
            try:
                yield
            finally:
                self._random = random.getstate()
                random.setstate(outside)


def listed_move(observation: str, rng: random.Random) -> str:
    """The default opponent's move: one of the bracketed moves the observation's last ``Available Moves:``
    line lists (``Valid moves:``, ``Available actions:`` likewise), drawn with ``rng``."""
    for line in reversed(observation.splitlines()):
        listed = MOVES_LINE.search(line)
        moves = re.findall(r"\[[^\[\]]+\]", listed.group(1)) if listed else []
        if moves:
            return rng.choice(moves)
    raise LmppoError(
        f"the default textarena opponent found no list of moves ('Available Moves: [a], [b]') in the game's "
        f"messages to it (the last: {observation[-200:]!r}); give the game an opponent of your own: "
        "textarena_environment(GAME-ID, opponent=function) in a file of yours, named as file.py:Class "
        "(docs/multiturn.md, textarena games)"
    )


def textarena_rows(game_id: str, size: int, seed: int) -> list[dict[str, Any]]:
    """``size`` prompt rows of ``game_id`` (``lmppo data textarena``): each game's first observation as the
    prompt, with the ``game_seed`` that makes it."""
    if not 1 <= size <= SEED_STRIDE:
        raise LmppoError(f"--size {size}: give 1 to {SEED_STRIDE} rows per file (more: several seeds)")
    game = textarena_environment(game_id)()
    seeds = range(seed * SEED_STRIDE, seed * SEED_STRIDE + size)
    return [{"prompt": game.start(game_seed), "game": game_id, "game_seed": game_seed} for game_seed in seeds]


def _random_listed_move(rng: random.Random) -> Callable[[str], str]:
    return lambda observation: listed_move(observation, rng)


def _game_seed(row: dict[str, Any], game_id: str) -> int:
    if not isinstance(row.get("game_seed"), int):
        raise LmppoError(
            f"rollout.environment textarena:{game_id}: a prompt row has no integer 'game_seed' (its columns: "
            f"{sorted(row)}); the rows hold each game's first observation and its seed: make them with "
            f"`lmppo data textarena {game_id} --size N --seed S --out prompts.jsonl`"
        )
    return row["game_seed"]


def _players(game_id: str) -> int:
    """How many players the game takes: 2 when its reset accepts two (a game of one refuses them), else 1."""
    ta, errors = _textarena(), []
    for players in (2, 1):
        game = ta.make(game_id)
        with _random_lock:
            saved = random.getstate()
            try:
                game.reset(num_players=players, seed=0)
                return players
            except Exception as err:  # textarena asserts the count in its reset
                errors.append(f"{players} players: {type(err).__name__}: {err}")
            finally:
                random.setstate(saved)
    raise LmppoError(
        f"rollout.environment textarena:{game_id}: the game resets with neither two players nor one "
        f"({'; '.join(errors)}); lmppo plays games of one or two players (a game may also need data it "
        "downloads, e.g. nltk's word lists: run it once online)"
    )


def _unwrapped(game):
    """The game under textarena's wrappers (each keeps what it wraps as ``.env``)."""
    while isinstance(game, _textarena().Wrapper):
        game = game.env
    return game


def _textarena():
    try:
        import textarena
    except ImportError as err:
        raise LmppoError(
            f"rollout.environment textarena:... needs the textarena package, which is not installed ({err}): "
            "`pip install 'lmppo[textarena]'`"
        ) from None
    return textarena


def _version() -> str:
    from importlib.metadata import version

    return version("textarena")
