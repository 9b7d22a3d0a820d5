"""textarena games as environments (lmppo.sampling.textarena_envs, ``rollout.environment: textarena:...``):
a one-player puzzle and a two-player game against the default and a user's opponent played through the made
class with scripted moves, refused moves as the game rules them, prompt rows that do not match their game,
and a PPO run that trains against a game from `lmppo data textarena` rows."""

from __future__ import annotations

import json
import random
import re

import pytest
import yaml
from helpers import run_cli

pytest.importorskip("textarena")

from lmppo.errors import LmppoError  # noqa: E402
from lmppo.sampling.environments import load_environment  # noqa: E402
from lmppo.sampling.textarena_envs import listed_move, textarena_environment, textarena_rows  # noqa: E402


def started(game_id: str, game_seed: int = 0, opponent=None):
    """The game's environment, reset on the prompt row of ``game_seed`` (as `lmppo data textarena` writes it)."""
    [row] = textarena_rows(game_id, size=1, seed=0) if game_seed == 0 else [None]
    environment = textarena_environment(game_id, opponent)()
    row = row or {"prompt": environment.start(game_seed), "game_seed": game_seed}
    environment.reset(row, seed=123)
    return environment, row["prompt"]


def first_available(observation: str) -> str:
    """A fixed opponent: the first move of the last 'Available Moves' line."""
    line = [line for line in observation.splitlines() if line.startswith("Available Moves")][-1]
    return re.findall(r"\[\d\]", line)[0]


def test_a_one_player_puzzle_played_by_bisection_is_won():
    game, prompt = started("GuessTheNumber-v0", game_seed=7)
    assert "guess the number between 1 and 20" in prompt and game.players == 1
    low, high = 1, 20
    for _ in range(10):
        guess = (low + high) // 2
        step = game.step(f"my guess is [{guess}]")
        if step.done:
            break
        [message] = step.messages
        assert message["role"] == "user" and f"[{guess}]" not in message["content"]  # its own move left out
        low, high = (guess + 1, high) if "higher" in message["content"] else (low, guess - 1)
    assert step.done and step.reward == 1.0


def test_a_refused_move_gets_another_try_then_ends_the_game_as_the_game_rules():
    game, _ = started("GuessTheNumber-v0")
    again = game.step("seven")
    assert not again.done and "attempted an invalid move" in again.messages[0]["content"]
    lost = game.step("still seven")
    assert lost.done and lost.reward == 0.0  # no guess made: no completion


def test_two_players_against_a_user_opponent_the_policy_wins():
    game, prompt = started("TicTacToe-v0", opponent=first_available)
    assert game.players == 2 and "You are Player 0 in Tic Tac Toe" in prompt
    for move, opponent_took in [("[0]", "[1]"), ("[3]", "[2]")]:
        step = game.step(move)
        content = step.messages[0]["content"]
        assert f"[Player 1] {opponent_took}" in content and "[Player 0]" not in content
    step = game.step("[6]")  # the first column
    assert step.done and step.reward == 1.0


def test_the_default_opponent_plays_listed_moves_the_same_for_the_same_game_seed():
    def play(game_seed: int) -> list[str]:
        game, _ = started("TicTacToe-v0", game_seed=game_seed)
        views, step = [], game.step("[4]")
        while not step.done:
            views.append(step.messages[0]["content"])
            step = game.step(first_available(views[-1]))
        assert step.reward in (-1.0, 0.0, 1.0)
        return views

    random.seed(5)
    expected = random.random()
    assert play(3) == play(3)
    assert any(play(3) != play(seed) for seed in (4, 5, 6))
    random.seed(5)
    assert random.random() == expected  # the process's random stream is left as it was


def test_the_default_opponent_without_a_list_of_moves_is_a_clear_error():
    assert listed_move("Board\nAvailable Moves: '[1]', '[7]'", random.Random(0)) in ("[1]", "[7]")
    with pytest.raises(LmppoError, match="found no list of moves.*opponent=function"):
        listed_move("[GAME] your move", random.Random(0))


def test_rows_that_do_not_hold_their_game_are_refused_naming_the_data_command():
    game = load_environment("textarena:TicTacToe-v0")()
    with pytest.raises(LmppoError, match="no integer 'game_seed'.*lmppo data textarena TicTacToe-v0"):
        game.reset({"prompt": "play tic tac toe"}, seed=0)
    with pytest.raises(LmppoError, match="does not hold the game's first observation"):
        game.reset({"prompt": "play tic tac toe", "game_seed": 0}, seed=0)
    with pytest.raises(LmppoError, match="has no game 'TicTacToe-v9'"):
        load_environment("textarena:TicTacToe-v9")


@pytest.mark.slow
def test_lmppo_ppo_trains_against_a_textarena_game(run_files, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    assert run_cli("data", "textarena", "TicTacToe-v0", "--size", "4", "--out", str(prompts)) == 0
    assert [json.loads(line)["game_seed"] for line in prompts.read_text().splitlines()] == [0, 1, 2, 3]
    config = yaml.safe_load(run_files.read_text())
    del config["reward"]  # the game's reward
    config["rollout"] |= {"environment": "textarena:TicTacToe-v0", "max_turns": 4, "max_new_tokens": 24}
    run_files.write_text(yaml.safe_dump(config))
    assert run_cli("ppo", str(run_files)) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if "episode/turns" in record]
    assert len(steps) == 2 and any(step["episode/context_tokens"] > 0 for step in steps)  # the game answered
    assert any(step["reward/turn"] < 0 for step in steps)  # a game lost to refused moves: its reward, -1
