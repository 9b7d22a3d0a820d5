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
- the answer is asked for plain (``Accept-Encoding: identity``); one layer of gzip or deflate is still read,
  but decoded as it arrives and never past that size (2 KiB of gzip can decode to a GiB), a corrupt or cut
  one is retried like a dropped connection, and stacked or other encodings are refused;
- only http(s), no proxy unless ``reward.url_proxy`` names one (``http_proxy`` is not read), and the bearer
  token only from the environment variable ``reward.url_token_env`` names, so no file holds it; a token no
  header can carry (a trailing ``\\r``, a space) is refused before any request, naming the variable, never the
  token;
- a URL no request can be sent to (a port past 65535) is one error naming it, never a traceback (the config
  check refuses it before, :func:`lmppo.inputs.config.check_reward_url`);
- a SIGINT or SIGTERM while a request waits cancels it at once (:func:`lmppo.signals.interruptible`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import time
import zlib
from collections.abc import Coroutine, Sequence

import torch

from lmppo.errors import LmppoError
from lmppo.inputs.data import Prompt
from lmppo.signals import interruptible

FIRST_PAUSE_S = 0.5  # before the first retry; doubled before each next one
ANSWER_BYTES_PER_ROW = 64  # a JSON number and its separator, with room to spare
ANSWER_BYTES_MIN = 64 * 1024  # an error page or a short JSON answer
FLOAT32_MAX = 3.4028234663852886e38  # scores are float32: a larger one would become infinite (NaN fails too)
CHAR_NAMES = {
    "\r": "a carriage return (\\r)",
    "\n": "a newline (\\n)",
    "\t": "a tab",
    " ": "a space",
}


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
        self.headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
        if token:
            check_token(token, token_env)
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
                received = await self._read(answer, cap)
        except TimeoutError:
            raise Retryable(f"no whole answer within reward.url_timeout_s={self.timeout_s:g} s") from None
        except httpx.RequestError as err:  # refused, dropped mid-answer, a bad status line, ...
            raise Retryable(f"{type(err).__name__}: {err}" if str(err) else type(err).__name__) from None
        # a URL the transport cannot even try: not to escape as a traceback (a port past 65535 raises these)
        except (httpx.InvalidURL, ValueError, OverflowError, ExceptionGroup) as err:
            raise self._unusable_url(err) from None
        if len(received) > cap:
            raise LmppoError(
                f"reward.url {self.url} answered more than {cap} bytes for {rows} rows; a reward server answers "
                "one number per row (docs/rewards.md)"
            )
        return received

    async def _read(self, answer, limit: int) -> bytes:
        """The answer's body, decoded as it arrives, read no further once it holds more than ``limit`` bytes:
        never more than ``limit`` + 1 are decoded, however many a few KiB of gzip would decode to."""
        inflate = self._inflater(answer.headers.get("content-encoding", ""))
        received = bytearray()
        async for chunk in answer.aiter_raw():  # httpx's own decoding would decode each chunk whole
            received += inflate(chunk, limit + 1 - len(received)) if inflate else chunk
            if len(received) > limit:
                return bytes(received)
        if inflate:
            inflate.end()
        return bytes(received)

    def _inflater(self, content_encoding: str) -> Inflate | None:
        """What undoes the answer's Content-Encoding: nothing, or one layer of gzip or deflate; anything else
        (layers stacked, br, zstd) was not asked for and is refused."""
        named = (e.strip().lower() for e in content_encoding.split(","))
        layers = [e for e in named if e not in ("", "identity")]
        if not layers:
            return None
        if len(layers) == 1 and layers[0] in Inflate.WBITS:
            return Inflate(layers[0])
        raise LmppoError(
            f"reward.url {self.url} answered in Content-Encoding {content_encoding[:100]!r}, though asked for "
            "none (Accept-Encoding: identity); lmppo reads one layer of gzip or deflate at most: have the server "
            "answer plain JSON"
        )

    def _unusable_url(self, err: Exception) -> LmppoError:
        """A URL the transport cannot even try (a port past 65535, from code that skipped the config check)."""
        while isinstance(err, ExceptionGroup):  # how anyio's connect lets out what it did not expect
            err = err.exceptions[0]
        return LmppoError(
            f"reward.url {self.url} is no address a request can be sent to ({type(err).__name__}: {err}); give the "
            "server's, like http://host:8000/score" + (", and check reward.url_proxy" if self.proxy else "")
        )

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
        text = (await self._read(answer, 300))[:300].decode(errors="replace")
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


class Inflate:
    """One layer of gzip or deflate undone as its bytes arrive, never more at a time than the room given."""

    WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}

    def __init__(self, encoding: str) -> None:
        self.encoding, self.zlib = encoding, zlib.decompressobj(self.WBITS[encoding])

    def __call__(self, chunk: bytes, room: int) -> bytes:
        try:
            decoded = self.zlib.decompress(chunk, room)  # input past the room is kept, not decoded
        except zlib.error as err:
            raise Retryable(f"a corrupt {self.encoding} body: {err}") from None
        if self.zlib.unused_data:
            raise Retryable(f"bytes after the end of its {self.encoding} body")
        return decoded

    def end(self) -> None:
        if not self.zlib.eof:
            raise Retryable(f"its {self.encoding} body cut short")


def check_token(token: str, variable: str) -> None:
    """A bearer token is visible ASCII (RFC 6750): anything else no header can carry, so it is refused before
    any request, saying what and where but never the token itself (a secret)."""
    place = next((i for i, char in enumerate(token) if not "!" <= char <= "~"), None)
    if place is None:
        return
    char = token[place]
    what = CHAR_NAMES.get(char) or ("a non-ASCII character" if ord(char) > 0x7F else "a control character")
    where = "at its end" if place == len(token) - 1 else f"at character {place + 1} of {len(token)}"
    raise LmppoError(
        f"the environment variable {variable} (reward.url_token_env) holds {what} {where}, which no HTTP header "
        f"can carry: a bearer token is visible ASCII only; set {variable} again without it (a token read from a "
        "file saved with Windows line endings ends in \\r)"
    )


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
