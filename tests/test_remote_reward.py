"""Rewards over HTTP: the client (reward.url) against servers started here on 127.0.0.1, and lmppo
serve-rm's server against the same reward model scored in-process."""

import time

import pytest
import yaml
from helpers import comparable, fake_server, run_cli, serving

from lmppo import remote_reward
from lmppo.errors import LmppoError
from lmppo.metrics import read_metrics
from lmppo.remote_reward import RemoteReward, reward_server
from lmppo.scoring import RewardModelScorer

PROMPTS = ["say good", [{"role": "user", "content": "say good twice"}], "hi"]
RESPONSES = ["good", "good good", "no"]


def client(url, **kwargs):
    return RemoteReward(url, **{"batch_size": 2, "timeout_s": 5.0, "retries": 2, **kwargs})


@pytest.fixture(autouse=True)
def short_pauses(monkeypatch):
    monkeypatch.setattr(remote_reward, "FIRST_PAUSE_S", 0.01)


def test_the_client_batches_and_retries_what_failed_on_the_server_side():
    answers = [(503, b"busy"), (502, b"gateway")]  # the first request fails twice, then is answered
    scores = client(serving(fake_server(answers)))(PROMPTS, RESPONSES)
    assert scores.tolist() == [1.0, 2.0, 0.0] and not answers


@pytest.mark.parametrize(
    "answer, message",
    [
        ((200, b"<html>"), "answered '<html>', not a JSON object"),
        ((200, {"scores": [1.0]}), "answered 1 rewards for 2 responses"),
        ((200, {"rewards": ["high", "low"]}), 'not a JSON object with "rewards"'),
        ((400, b"prompts missing"), "refused the request: HTTP 400 prompts missing"),
    ],
)
def test_a_malformed_or_refused_answer_is_an_error_naming_the_url(answer, message):
    url = serving(fake_server([answer]))
    with pytest.raises(LmppoError, match=f"reward.url {url}") as err:
        client(url)(PROMPTS, RESPONSES)
    assert message in str(err.value)


def test_an_unreachable_or_silent_server_is_an_error_after_the_retries_never_a_hang():
    silent = serving(fake_server([1.0, 1.0, 1.0]))  # each answer takes longer than the timeout
    start = time.monotonic()
    with pytest.raises(LmppoError, match="did not answer .* in 3 tries of at most 0.2 s each"):
        client(silent, timeout_s=0.2)(PROMPTS, RESPONSES)
    assert time.monotonic() - start < 3
    with pytest.raises(LmppoError, match="did not answer .*lmppo serve-rm"):
        client("http://127.0.0.1:9/score")(PROMPTS, RESPONSES)  # the discard port: nothing listens


def test_serve_rm_scores_as_the_reward_model_does_in_process(tmp_path, make_reward_model, reward_tokenizer):
    model = make_reward_model(reward_tokenizer)
    model.save_pretrained(tmp_path / "rm")
    reward_tokenizer.save_pretrained(tmp_path / "rm")
    url = serving(reward_server(str(tmp_path / "rm"), "127.0.0.1", 0, batch_size=2))
    local = RewardModelScorer(model, reward_tokenizer)(PROMPTS, RESPONSES)
    assert client(url, batch_size=3)(PROMPTS, RESPONSES).tolist() == pytest.approx(local.tolist(), abs=1e-5)
    openrlhf = client(url)._post({"query": ["say good good", "hi"], "responses": ["", ""]})
    assert len(openrlhf) == 2  # OpenRLHF's request shape: full texts, scored as plain text


def test_a_run_scored_over_http_takes_the_steps_of_the_same_function_in_process(run_files):
    assert run_cli("ppo", str(run_files)) == 0
    config = yaml.safe_load(run_files.read_text())
    config["reward"] = {"url": serving(fake_server([]))}  # the server answers with count_good
    config["run"]["output_dir"] = str(run_files.parent / "over_http")
    (run_files.parent / "http.yaml").write_text(yaml.safe_dump(config))
    assert run_cli("ppo", str(run_files.parent / "http.yaml")) == 0
    in_process, over_http = (
        read_metrics(run_files.parent / "run"),
        read_metrics(run_files.parent / "over_http"),
    )
    assert comparable(over_http) == comparable(in_process)
