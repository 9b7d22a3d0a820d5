"""Rewards over HTTP, the client: ``reward.url`` (the server, ``lmppo serve-rm``, is
:mod:`lmppo.rewards.reward_server`).

The wire format (docs/rewards.md): POST a JSON object ``{"prompts": [...], "responses": [...]}`` (a prompt
is a string or a list of ``{"role", "content"}`` messages), answer ``{"rewards": [one number per row]}``.

A training run must neither hang on a server nor train on numbers nobody computed for its responses:
- each request of at most ``reward.batch_size`` rows has one deadline, ``reward.url_timeout_s``, for all of
  it (connect, send, the whole answer), however slowly a server trickles its bytes;
- what a retry may mend (a connection refused or dropped, a bad status line, a timeout, HTTP 5xx) is tried
  ``reward.url_retries`` more times after doubling pauses, then reported as one error naming the URL;
- what it cannot is reported at once: a refusal (4xx), a redirect (a POST re-sent elsewhere as a GET would
  score nothing of ours), an answer larger than its rows can need, or one that is not one real number
  within float32's range per row (booleans, ``NaN``, ``Infinity``, ``1e308`` and strings refused);
- only http(s), no proxy unless ``reward.url_proxy`` names one (``http_proxy`` is not read), and the bearer
  token only from the environment variable ``reward.url_token_env`` names, so no file holds it;
- a SIGINT or SIGTERM while a request waits cancels it at once (:func:`lmppo.signals.interruptible`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import time
from collections.abc import Coroutine, Sequence

import torch

from lmppo.errors import LmppoError
from lmppo.inputs.data import Prompt
from lmppo.signals import interruptible

FIRST_PAUSE_S = 0.5  # before the first retry; doubled before each next one
ANSWER_BYTES_PER_ROW = 64  # a JSON number and its separator, with room to spare
ANSWER_BYTES_MIN = 64 * 1024  # an error page or a short JSON answer
FLOAT32_MAX = 3.4028234663852886e38  # scores are float32: a larger one would become infinite (NaN fails too)


class Retryable(Exception):
    """A failure a second try may mend: the message says what happened."""


class RemoteReward:
    """``(prompts, responses) -> (B,)`` scores from a reward server at ``url``."""

    def __init__(
        self,
        url: str,
        *,
        batch_size: int,
        timeout_s: float,
        retries: int,
        token_env: str = "LMPPO_REWARD_TOKEN",
        proxy: str | None = None,
    ) -> None:
        self.url, self.batch_size, self.timeout_s, self.retries = url, batch_size, timeout_s, retries
        self.token_env, self.proxy = token_env, proxy
        token = os.environ.get(token_env)
        self.headers = {"Content-Type": "application/json"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"

    def __call__(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> torch.Tensor:
        scores: list[float] = []
        for start in range(0, len(responses), self.batch_size):
            rows = slice(start, start + self.batch_size)
            scores += self._post({"prompts": list(prompts[rows]), "responses": list(responses[rows])})
        return torch.tensor(scores, dtype=torch.float32)

    def _post(self, payload: dict) -> list[float]:
        """One batch's scores: asked again after what a retry may mend, refused at once otherwise."""
        body, rows = json.dumps(payload).encode(), len(payload["responses"])
        failure = ""
        for attempt in range(self.retries + 1):
            try:
                with interruptible():  # a signal cuts the pause or the wait short
                    if attempt:
                        time.sleep(FIRST_PAUSE_S * 2 ** (attempt - 1))
                    answer = run_coroutine(self._ask(body, rows))
                return self._scores(answer, rows)
            except Retryable as err:
                failure = str(err)
        raise LmppoError(
            f"reward.url {self.url} did not answer ({failure}) in {self.retries + 1} tries of at most "
            f"{self.timeout_s:g} s each; start the server (`lmppo serve-rm MODEL --port PORT`) or fix the URL, "
            "or raise reward.url_timeout_s / reward.url_retries"
        )

    async def _ask(self, body: bytes, rows: int) -> bytes:
        """The answer's body, within the deadline for the whole request; at most what ``rows`` can need."""
        import httpx

        cap = max(ANSWER_BYTES_MIN, ANSWER_BYTES_PER_ROW * rows)
        try:
            async with (
                asyncio.timeout(self.timeout_s),
                httpx.AsyncClient(trust_env=False, proxy=self.proxy, timeout=None) as client,
                client.stream("POST", self.url, content=body, headers=self.headers) as answer,
            ):
                await self._check_status(answer)
                received = bytearray()
                async for chunk in answer.aiter_bytes():
                    received += chunk
                    if len(received) > cap:
                        raise LmppoError(
                            f"reward.url {self.url} answered more than {cap} bytes for {rows} rows; a reward "
                            "server answers one number per row (docs/rewards.md)"
                        )
                return bytes(received)
        except TimeoutError:
            raise Retryable(f"no whole answer within reward.url_timeout_s={self.timeout_s:g} s") from None
        except httpx.TransportError as err:  # refused, dropped mid-answer, a bad status line, ...
            raise Retryable(f"{type(err).__name__}: {err}" if str(err) else type(err).__name__) from None

    async def _check_status(self, answer) -> None:
        """2xx goes on; 5xx may be retried; a redirect or another refusal is an error at once."""
        status = answer.status_code
        if status < 300:
            return
        if status >= 500:
            raise Retryable(f"HTTP {status}")
        if status < 400:
            raise LmppoError(
                f"reward.url {self.url} answered HTTP {status}, a redirect to {answer.headers.get('location')!r}; "
                "lmppo follows none (the POST would be re-sent elsewhere, or as a GET, and the rewards taken "
                "from a server that never saw the responses): set reward.url to the server's own address"
            )
        text = (await answer.aread())[:300].decode(errors="replace")
        hint = (
            f": set its token in the environment variable {self.token_env} (reward.url_token_env)"
            if status in (401, 403)
            else ""
        )
        raise LmppoError(f"reward.url {self.url} refused the request: HTTP {status} {text}{hint}")

    def _scores(self, body: bytes, rows: int) -> list[float]:
        """The answer's scores, checked: a JSON object with one real number per row, within float32's range."""
        try:
            answer = json.loads(body, parse_constant=_refuse_constant, parse_int=float)  # 10**400 -> inf
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
            answer = None
        scores = answer.get("rewards", answer.get("scores")) if isinstance(answer, dict) else None
        numbers = isinstance(scores, list) and all(
            isinstance(s, int | float) and not isinstance(s, bool) and abs(s) <= FLOAT32_MAX for s in scores
        )
        if not numbers:
            raise LmppoError(
                f"reward.url {self.url} answered {body[:200].decode(errors='replace')!r}, not a JSON object with "
                '"rewards": [one finite number per response]; see the wire format in docs/rewards.md'
            )
        if len(scores) != rows:
            raise LmppoError(f"reward.url {self.url} answered {len(scores)} rewards for {rows} responses")
        return [float(s) for s in scores]


def _refuse_constant(name: str):
    """JSON's non-standard ``NaN`` and ``Infinity`` are no reward."""
    raise ValueError(f"{name} is not a number a reward can be")


def run_coroutine(coroutine: Coroutine):
    """Run ``coroutine`` to its end from synchronous code: here, or on a thread of its own when this
    thread already runs an event loop (a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()
