"""OpenEnv environments (lmppo.sampling.openenv_envs, ``rollout.environment: openenv:...``) against a real
OpenEnv server (tests/openenv_server.py, served on 127.0.0.1 by a subprocess): a session reset and stepped,
a dropped connection replayed once, episodes played by the generator, the class in-process, and a PPO run
that trains against the server and stops with a message naming it when the server is killed."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from helpers import llama_config, run_cli
from test_tools import ScriptedTurns
from transformers import LlamaForCausalLM

pytest.importorskip("openenv")  # lmppo[openenv]: the vLLM and oldest-versions environments may lack it

from lmppo.errors import LmppoError  # noqa: E402
from lmppo.runs.checkpoint import latest_checkpoint, load_checkpoint  # noqa: E402
from lmppo.sampling.engines import sample_seed  # noqa: E402
from lmppo.sampling.environments import Step  # noqa: E402
from lmppo.sampling.episodes import EpisodeGenerator  # noqa: E402
from lmppo.sampling.hf_engine import hf_generator  # noqa: E402
from lmppo.sampling.openenv_envs import openenv_environment  # noqa: E402
from lmppo.toy.tokenizer import tools_tokenizer  # noqa: E402

SERVER = Path(__file__).resolve().parent / "openenv_server.py"
START_TIMEOUT_S = 60.0  # the server imports openenv: seconds on a busy CPU


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(max_sessions: int) -> tuple[subprocess.Popen, str]:
    """The test environment served on a free port of 127.0.0.1, once its /health answers."""
    port = free_port()
    process = subprocess.Popen([sys.executable, str(SERVER), str(port), str(max_sessions)])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1.0):
                return process, url
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"the OpenEnv test server did not start at {url}")


@pytest.fixture(scope="module")
def server():
    process, url = start_server(max_sessions=4)
    yield url
    process.kill()
    process.wait()


def test_a_session_is_reset_with_the_row_and_seed_and_stepped_on_the_policy_s_turns(server):
    environment = openenv_environment(server)
    assert (environment.action_field, environment.observation_field) == ("text", "message")

    async def episode() -> list[Step]:
        env = environment()
        await env.reset({"prompt": "guess", "word": "cat"}, seed=7)  # the prompt: not a reset argument
        return [await env.step("a dog"), await env.step("a cat")]

    wrong, right = asyncio.run(episode())
    assert wrong == Step(messages=[{"role": "user", "content": "no (seed 7, turn 1)"}], reward=0.0)
    assert right == Step(reward=1.0, done=True)


def test_a_dropped_connection_is_opened_again_once_and_the_episode_replayed(server):
    async def episode() -> tuple[Step, LmppoError]:
        env = openenv_environment(server)()
        await env.reset({"word": "cat"}, seed=3)
        await env.step("a dog")
        await env.client.disconnect()  # the socket closes: the server ends that session
        replayed = await env.step("a bird")  # on a new session, reset and the first turn stepped again
        await env.client.disconnect()
        with pytest.raises(LmppoError) as lost:
            await env.step("a bird")
        return replayed, lost.value

    replayed, lost = asyncio.run(episode())
    assert replayed.messages == [{"role": "user", "content": "no (seed 3, turn 2)"}]
    assert server in str(lost) and "connected again once" in str(lost)


def test_a_server_that_is_not_there_is_an_error_naming_its_url():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(LmppoError, match="no OpenEnv server answers at " + url):
        openenv_environment(url)


def open_sessions(url: str) -> int:
    with urllib.request.urlopen(f"{url}/sessions", timeout=5.0) as answer:
        return json.load(answer)


def test_the_episode_generator_plays_episodes_against_the_server_and_closes_their_sessions(server):
    tokenizer = tools_tokenizer(["a dog", "good", "no (seed 1, turn 1)", "guess the word"])
    generator = hf_generator(LlamaForCausalLM(llama_config(tokenizer)), tokenizer, max_new_tokens=8)
    eos = [tokenizer.eos_token_id]
    turns = [tokenizer("a dog").input_ids + eos, tokenizer("good").input_ids + eos]
    episodes = EpisodeGenerator(
        ScriptedTurns(generator.engine, turns),
        generator.renderer,
        openenv_environment(server),
        name=f"openenv:{server}",
        max_turns=2,
        max_total_tokens=100,
        seed=0,
    )
    rows = [{"prompt": "guess the word", "word": word} for word in ("good", "cat")]
    rollout = episodes.generate(["guess the word"] * 2, policy_version=0, sample_ids=[4, 5], rows=rows)
    assert rollout.episode.counts["turns"].tolist() == [2, 2]
    assert rollout.terminated.tolist() == [True, False]  # "cat" is never guessed: cut at max_turns
    assert rollout.episode.turn_rewards.sum(dim=1).tolist() == [1.0, 0.0]
    for transcript, sample_id in zip(rollout.episode.transcripts, (4, 5), strict=True):
        context = "".join(text for text, is_action in transcript if not is_action)
        assert f"no (seed {sample_seed(0, sample_id)}, turn 1)" in context
    deadline = time.monotonic() + 10.0  # the sessions close on the generator's loop, a moment later
    while open_sessions(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert open_sessions(server) == 0  # the finished episode's and the cut one's
    episodes.close()


def test_an_environment_class_of_an_openenv_package_plays_in_process():
    environment = openenv_environment(f"{SERVER}:Guess")
    env = environment()
    env.reset({"prompt": "guess", "word": "cat"}, seed=2)
    assert env.step("a dog") == Step(messages=[{"role": "user", "content": "no (seed 2, turn 1)"}])
    assert env.step("a cat") == Step(reward=1.0, done=True)


def test_an_action_without_one_string_field_needs_the_action_hook_and_a_subclass_gives_it():
    environment = openenv_environment(f"{SERVER}:GuessWithNotes")
    env = environment()
    env.reset({"word": "cat"}, seed=2)
    with pytest.raises(LmppoError, match="no single string field.*define action"):
        env.step("a cat")

    class Noted(environment):
        def action(self, text):
            return {"word": text, "note": "typed"}

        def messages(self, observation):
            return [{"role": "user", "content": observation["message"].upper()}]

    env = Noted()
    env.reset({"word": "cat"}, seed=2)
    assert env.step("a dog").messages == [{"role": "user", "content": "NO (SEED 2, TURN 1)"}]


def test_a_class_that_is_not_an_openenv_environment_is_refused_naming_it():
    with pytest.raises(LmppoError, match="is not an OpenEnv Environment subclass"):
        openenv_environment("lmppo.sampling.environments:SingleTurn")


KILLS_THE_SERVER = """
import os
import signal

from lmppo.runs.checkpoint import latest_checkpoint


def kills_the_server_after_step_1(prompts, responses):
    '''Scores nothing; once step 1's checkpoint is saved, kills the OpenEnv server (in step 2's scoring).'''
    checkpoint = latest_checkpoint({run!r})
    if checkpoint is not None and checkpoint.name == "step-000001":
        os.kill({pid}, signal.SIGKILL)
    return [0.0] * len(responses)
"""


@pytest.mark.slow
def test_lmppo_ppo_trains_against_the_server_and_stops_naming_it_when_it_dies(run_files, tmp_path, capsys):
    process, url = start_server(max_sessions=8)  # the pre-flight's 8 episodes at once
    try:
        run = tmp_path / "run"
        rows = [{"prompt": prompt, "word": "good"} for prompt in ["guess my word", "say a word"] * 4]
        (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        (tmp_path / "killer.py").write_text(KILLS_THE_SERVER.format(run=str(run), pid=process.pid))
        config = yaml.safe_load(run_files.read_text())
        config["reward"] = {"function": f"{tmp_path / 'killer.py'}:kills_the_server_after_step_1"}
        config["rollout"] |= {"environment": f"openenv:{url}", "max_turns": 2, "max_new_tokens": 24}
        config["run"] |= {"steps": 3, "checkpoint_every": 1}
        run_files.write_text(yaml.safe_dump(config))
        assert run_cli("ppo", str(run_files)) != 0
    finally:
        process.kill()
        process.wait()
    err = capsys.readouterr().err
    assert f"the OpenEnv server at {url} does not answer" in err and "Traceback" not in err
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if "episode/turns" in record]
    assert len(steps) == 2 and max(record["episode/turns"] for record in steps) > 1  # the server answered
    assert latest_checkpoint(run).name == "step-000002"
    load_checkpoint(latest_checkpoint(run))  # every file matches its manifest
