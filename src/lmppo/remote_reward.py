"""Rewards over HTTP: ``reward.url`` (the client) and ``lmppo serve-rm`` (a reward model on a port).

A reward model too large for the training GPU runs elsewhere, with its own tokenizer and chat template.

The wire format (docs/rewards.md): POST a JSON object ``{"prompts": [...], "responses": [...]}`` (a prompt
is a string or a list of ``{"role", "content"}`` messages), answer ``{"rewards": [one float per row]}``.
The server also takes OpenRLHF's remote-RM request, ``{"query": [full texts]}``, scored as plain text.
The client sends ``reward.batch_size`` rows per request, waits at most ``reward.url_timeout_s`` for each,
and retries a failed or timed-out request ``reward.url_retries`` times with doubling pauses: it never
hangs, and what it cannot get is an error naming the URL.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, HTTPServer

import torch

from lmppo.data import Prompt
from lmppo.errors import LmppoError

FIRST_PAUSE_S = 0.5  # before the first retry; doubled before each next one


class RemoteReward:
    """``(prompts, responses) -> (B,)`` scores from a reward server at ``url``."""

    def __init__(self, url: str, *, batch_size: int, timeout_s: float, retries: int) -> None:
        self.url, self.batch_size, self.timeout_s, self.retries = url, batch_size, timeout_s, retries

    def __call__(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> torch.Tensor:
        scores: list[float] = []
        for start in range(0, len(responses), self.batch_size):
            rows = slice(start, start + self.batch_size)
            scores += self._post({"prompts": list(prompts[rows]), "responses": list(responses[rows])})
        return torch.tensor(scores, dtype=torch.float32)

    def _post(self, payload: dict) -> list[float]:
        request = urllib.request.Request(
            self.url, json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
        )
        failure = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(FIRST_PAUSE_S * 2 ** (attempt - 1))
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                    body = answer.read()
                return self._scores(body, len(payload["responses"]))
            except urllib.error.HTTPError as err:
                if err.code < 500:  # the server understood and refused: asking again changes nothing
                    raise LmppoError(
                        f"reward.url {self.url} refused the request: HTTP {err.code} "
                        f"{err.read()[:300].decode(errors='replace')}"
                    ) from None
                failure = f"HTTP {err.code}"
            except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
                failure = str(getattr(err, "reason", err))
        raise LmppoError(
            f"reward.url {self.url} did not answer ({failure}) in {self.retries + 1} tries of at most "
            f"{self.timeout_s:g} s each; start the server (`lmppo serve-rm MODEL --port PORT`) or fix the URL, "
            "or raise reward.url_timeout_s / reward.url_retries."
        )

    def _scores(self, body: bytes, rows: int) -> list[float]:
        """The answer's scores, checked: a JSON object with one number per row."""
        try:
            answer = json.loads(body)
        except json.JSONDecodeError:
            answer = None
        scores = answer.get("rewards", answer.get("scores")) if isinstance(answer, dict) else None
        if not (isinstance(scores, list) and all(isinstance(s, int | float) for s in scores)):
            raise LmppoError(
                f"reward.url {self.url} answered {body[:200].decode(errors='replace')!r}, not a JSON object with "
                '"rewards": [one number per response]; see the wire format in docs/rewards.md'
            )
        if len(scores) != rows:
            raise LmppoError(f"reward.url {self.url} answered {len(scores)} rewards for {rows} responses")
        return [float(s) for s in scores]


# --------------------------------------------------------------------------------------------------
# The server: lmppo serve-rm
# --------------------------------------------------------------------------------------------------


def reward_server(
    model_path: str, host: str, port: int, *, batch_size: int, chat_template: str | None = None
):
    """An HTTP server scoring with the reward model at ``model_path`` (its own tokenizer and template);
    call ``serve_forever()`` on it. One request is scored at a time."""
    from lmppo.config import ModelSource
    from lmppo.loading import load_reward_model, load_tokenizer
    from lmppo.scoring import RewardModelScorer

    source = ModelSource(path=model_path, chat_template=chat_template)
    model, tokenizer = load_reward_model(source), load_tokenizer(source)
    scorers = {
        raw: RewardModelScorer(
            model, tokenizer, chat_template=chat_template, raw_text=raw, batch_size=batch_size
        )
        for raw in (False, True)
    }
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            try:
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                prompts, responses, raw = _rows_of(request)
                with lock:
                    scores = scorers[raw](prompts, responses).tolist()
            except (LmppoError, ValueError, KeyError, TypeError) as err:
                return self._answer(400, {"error": str(err)})
            self._answer(200, {"rewards": scores})  # NaN stays NaN: the run's nonfinite guard decides

        def _answer(self, status: int, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args) -> None:  # noqa: A002 - one quiet line per request instead
            pass

    return HTTPServer((host, port), Handler)


def _rows_of(request) -> tuple[list, list[str], bool]:
    """``(prompts, responses, raw_text)`` of a request: lmppo's shape, or OpenRLHF's ``query`` texts."""
    if not isinstance(request, dict):
        raise ValueError('the request must be a JSON object: {"prompts": [...], "responses": [...]}')
    if "query" in request:
        queries = request["query"]
        return list(queries), [""] * len(queries), True
    prompts, responses = request["prompts"], request["responses"]
    if len(prompts) != len(responses):
        raise ValueError(
            f"{len(prompts)} prompts and {len(responses)} responses; give one prompt per response"
        )
    return list(prompts), list(responses), False
