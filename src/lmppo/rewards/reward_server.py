"""``lmppo serve-rm``: a reward model on a port, for ``reward.url`` (its client is
:mod:`lmppo.rewards.remote_reward`).

An ASGI app (Starlette) on uvicorn (``pip install 'lmppo[serve]'``), made to face careless or hostile peers:
- ``POST /score`` (also ``/get_reward``, OpenRLHF's path) takes ``{"prompts": [...], "responses": [...]}``,
  rendered with the reward model's own tokenizer and chat template (no text becomes a control token), or
  OpenRLHF's ``{"query": [whole texts]}``, rendered as OpenRLHF's server does; it answers
  ``{"rewards": [...]}``. ``GET /health`` says which model serves, on what device, and the queue's depth.
- Limits, each refused with a JSON ``{"error": ...}``: the body's size (413), rows per request and
  characters per text (400), a body that does not arrive within the timeout (408), a full queue (503).
- A connection that sends no whole request head within the idle timeout is closed (idle and slow-loris
  peers hold nothing), requests are served concurrently, and the queued requests' rows are scored together
  in the model's batches, one at a time, off the event loop.
- An optional bearer token (``--token`` or ``LMPPO_REWARD_TOKEN``); 127.0.0.1 unless told otherwise.
- One access-log line per request: client, method, path, status, rows, milliseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from dataclasses import dataclass, field

from lmppo.errors import LmppoError, warn
from lmppo.inputs.data import as_messages
from lmppo.rewards.scoring import RewardModelScorer

log = logging.getLogger("lmppo.serve")
PATHS = ("/score", "/get_reward")  # lmppo's, and OpenRLHF's remote reward model's


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server, and how long a peer may take to ask it."""

    max_body_bytes: int = 16 * 2**20
    max_rows: int = 4096
    max_chars: int = 200_000  # per prompt, response or query text
    queue: int = 256  # requests waiting for the model; more get 503
    connections: int = 512  # open at once; more get 503
    timeout_s: float = 30.0  # to receive a request's body
    idle_s: float = 10.0  # to receive a request's head, on a new or a kept-alive connection


class RequestError(Exception):
    """A request the server refuses: its HTTP status and a message for the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Rows:
    """A request's rows: chat rows (prompts and responses) or whole ``query`` texts."""

    prompts: list = field(default_factory=list)
    responses: list[str] = field(default_factory=list)
    queries: list[str] | None = None

    def __len__(self) -> int:
        return len(self.queries) if self.queries is not None else len(self.responses)

    def rendered(self, scorer: RewardModelScorer) -> list[list[int]]:
        if self.queries is not None:
            return [scorer.render_query(text) for text in self.queries]
        return [scorer.render(p, r) for p, r in zip(self.prompts, self.responses, strict=True)]


def parse_rows(body: bytes, limits: Limits) -> Rows:
    """A request's rows, checked: the shapes of the wire format, and the limits."""
    try:
        request = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RequestError(400, "the body is not JSON") from None
    if not isinstance(request, dict):
        raise RequestError(400, 'the request must be a JSON object: {"prompts": [...], "responses": [...]}')
    if "query" in request:
        rows = Rows(queries=_texts(request["query"], "query"))
    else:
        if "prompts" not in request or "responses" not in request:
            raise RequestError(400, 'give "prompts" and "responses" (or OpenRLHF\'s "query")')
        rows = Rows(_prompts(request["prompts"]), _texts(request["responses"], "responses"))
        if len(rows.prompts) != len(rows.responses):
            raise RequestError(
                400,
                f"{len(rows.prompts)} prompts and {len(rows.responses)} responses; give one prompt per response",
            )
    if len(rows) > limits.max_rows:
        raise RequestError(400, f"{len(rows)} rows; this server takes at most {limits.max_rows} per request")
    texts = rows.queries or [*rows.responses, *(m["content"] for p in rows.prompts for m in as_messages(p))]
    longest = max((len(text) for text in texts), default=0)
    if longest > limits.max_chars:
        raise RequestError(
            400, f"a text of {longest} characters; this server takes at most {limits.max_chars}"
        )
    return rows


def _texts(value, key: str) -> list[str]:
    if not (isinstance(value, list) and all(isinstance(text, str) for text in value)):
        raise RequestError(400, f'"{key}" must be a list of strings')
    return value


def _prompts(value) -> list:
    """Each prompt a string or a list of {"role", "content"} messages with string content."""

    def is_message(m) -> bool:
        return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)

    if isinstance(value, list) and all(
        isinstance(p, str) or (isinstance(p, list) and p and all(is_message(m) for m in p)) for p in value
    ):
        return value
    raise RequestError(400, '"prompts" must be a list of strings or of lists of {"role", "content"} messages')


@dataclass(eq=False)
class Job:
    """A request waiting for its scores: its rows, rendered on first use, and the scores so far."""

    rows: Rows
    answer: asyncio.Future
    ids: list[list[int]] | None = None
    scores: list[float] = field(default_factory=list)
    error: RequestError | None = None

    @property
    def left(self) -> int:
        return 0 if self.error else len(self.rows) - len(self.scores)


class Batcher:
    """Requests wait in a bounded line; one worker fills each model batch from it (:meth:`_next_batch`)
    and computes the batch on a thread, so the event loop keeps serving meanwhile."""

    def __init__(self, scorer: RewardModelScorer, queue: int) -> None:
        self.scorer, self.limit = scorer, queue
        self.waiting: list[Job] = []
        self.arrived = asyncio.Event()

    async def score(self, rows: Rows) -> list[float]:
        if len(self.waiting) >= self.limit:
            raise RequestError(503, "the server is busy: its queue is full; retry later")
        job = Job(rows, asyncio.get_running_loop().create_future())
        self.waiting.append(job)
        self.arrived.set()
        return await job.answer

    async def work(self) -> None:
        while True:
            if not self.waiting:
                self.arrived.clear()
                await self.arrived.wait()
            batch = self._next_batch()
            try:
                await asyncio.to_thread(self._score, batch)
            except (
                Exception
            ) as err:  # the model failed (out of memory, a bug): these requests, not the server
                log.exception("scoring failed")
                for job, _ in batch:
                    job.error = RequestError(500, f"scoring failed: {type(err).__name__}: {err}")
            self._answer_finished()

    def _next_batch(self) -> list[tuple[Job, int]]:
        """(job, how many of its rows) for one model batch: whole requests in line order while they fit;
        a request larger than a batch gets batches of its own, one at a time, and goes back to the end of
        the line after each, so a small request waits one batch behind it, not all of it. A request alone
        in line, or larger than a batch, is grouped as scoring it alone groups it: the same numbers."""
        size, batch, room = self.scorer.batch_size, [], self.scorer.batch_size
        for job in self.waiting:
            if len(job.rows) > size:
                if batch:
                    continue
                self.waiting.remove(job)
                self.waiting.append(job)
                return [(job, min(size, job.left))]
            if job.left <= room:
                batch.append((job, job.left))
                room -= job.left
        return batch

    def _score(self, batch: list[tuple[Job, int]]) -> None:
        """Render each job on first use (a request that cannot be rendered fails alone), then score."""
        for job, _ in batch:
            if job.ids is None:
                try:
                    job.ids = job.rows.rendered(self.scorer)
                except LmppoError as err:
                    job.error = RequestError(400, str(err))
        scored = [(job, n) for job, n in batch if job.error is None]
        rows = [row for job, n in scored for row in job.ids[len(job.scores) : len(job.scores) + n]]
        scores = self.scorer.score_ids(rows).tolist()
        for job, n in scored:
            job.scores, scores = job.scores + scores[:n], scores[n:]

    def _answer_finished(self) -> None:
        for job in [job for job in self.waiting if not job.left]:
            self.waiting.remove(job)
            if job.answer.done():  # its client is gone
                continue
            if job.error is not None:
                job.answer.set_exception(job.error)
            else:
                job.answer.set_result(job.scores)


def reward_app(
    scorer: RewardModelScorer, identity: dict, limits: Limits = Limits(), token: str | None = None
):
    """The Starlette app serving ``scorer`` (a reward model with its tokenizer and template)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    batcher = Batcher(scorer, limits.queue)

    async def score(request) -> JSONResponse:
        try:
            _authorize(request, token)
            rows = parse_rows(await _body(request, limits), limits)
            request.state.rows = len(rows)
            return JSONResponse({"rewards": await batcher.score(rows)})
        except RequestError as err:
            return JSONResponse({"error": str(err)}, status_code=err.status)

    async def health(request) -> JSONResponse:
        try:
            _authorize(request, token)
        except RequestError as err:
            return JSONResponse({"error": str(err)}, status_code=err.status)
        device = str(next(scorer.token_scores.parameters()).device)
        body = {"status": "ok", "model": identity, "device": device, "batch_size": scorer.batch_size}
        return JSONResponse({**body, "queue": len(batcher.waiting), "queue_max": limits.queue})

    async def refused(request, err: HTTPException) -> JSONResponse:
        allowed = f"; POST {' or '.join(PATHS)}, GET /health" if err.status_code in (404, 405) else ""
        return JSONResponse({"error": f"{err.detail}{allowed}"}, status_code=err.status_code)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker = asyncio.create_task(batcher.work())
        yield
        worker.cancel()

    routes = [
        *(Route(path, score, methods=["POST"]) for path in PATHS),
        Route("/health", health, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: refused}, lifespan=lifespan)
    return AccessLog(app)


def _authorize(request, token: str | None) -> None:
    if token and not hmac.compare_digest(request.headers.get("authorization", ""), f"Bearer {token}"):
        raise RequestError(401, "this server needs its bearer token (Authorization: Bearer ...)")


async def _body(request, limits: Limits) -> bytes:
    """The request's body, refused when larger than the limit or slower than the timeout to arrive."""
    declared = request.headers.get("content-length", "")
    too_large = f"the body is larger than this server's limit of {limits.max_body_bytes} bytes"
    if declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise RequestError(413, too_large)
    body = bytearray()
    try:
        async with asyncio.timeout(limits.timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limits.max_body_bytes:
                    raise RequestError(413, too_large)
    except TimeoutError:
        raise RequestError(408, f"the body did not arrive within {limits.timeout_s:g} s") from None
    return bytes(body)


class AccessLog:
    """One line per request: client, method, path, status, rows scored, milliseconds."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.perf_counter(), [500]

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            client = ":".join(map(str, scope.get("client") or ("-",)))
            rows = scope.get("state", {}).get("rows", "-")
            ms = (time.perf_counter() - started) * 1000
            log.info(f"{client} {scope['method']} {scope['path']} {status[0]} rows={rows} {ms:.0f} ms")


def idle_timeout_protocol():
    """uvicorn's h11 protocol, with its keep-alive timer also running from a connection's start: a peer
    that never sends a whole request head is disconnected after ``timeout_keep_alive`` (uvicorn would wait
    for it forever)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class IdleTimeoutH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

    return IdleTimeoutH11Protocol


def uvicorn_server(app, limits: Limits = Limits()):
    """A uvicorn server for ``app`` with the limits' timeouts; run it with ``server.run(sockets=[...])``."""
    import uvicorn

    config = uvicorn.Config(
        app,
        http=idle_timeout_protocol(),
        timeout_keep_alive=limits.idle_s,
        limit_concurrency=limits.connections,
        access_log=False,  # AccessLog writes one line with the rows and the time
        log_level="warning",
        lifespan="on",
    )
    return uvicorn.Server(config)


def load_scorer(
    model_path: str, batch_size: int, chat_template: str | None
) -> tuple[RewardModelScorer, dict]:
    """The reward model at ``model_path`` as a scorer (its own tokenizer and template), and its identity."""
    from lmppo.inputs.config import ModelSource
    from lmppo.modeling.loading import load_reward_model, load_tokenizer, resolve_source
    from lmppo.modeling.models import model_identity

    source = ModelSource(path=model_path, chat_template=chat_template)
    model, tokenizer = load_reward_model(source), load_tokenizer(source)
    has_template = chat_template is not None or bool(tokenizer.chat_template)
    scorer = RewardModelScorer(
        model, tokenizer, chat_template=chat_template, chats=has_template, batch_size=batch_size
    )
    identity = model_identity(
        "reward", model, source=resolve_source(source), tokenizer=tokenizer, chat_template=chat_template
    ).to_dict()
    return scorer, identity


def require_serving_stack() -> None:
    """serve-rm's HTTP stack is an extra: say how to install it when it is missing."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise LmppoError(
            f"lmppo serve-rm needs starlette and uvicorn ({err}); install them with `pip install 'lmppo[serve]'`"
        ) from None


def serve(
    model_path: str,
    host: str,
    port: int,
    *,
    batch_size: int,
    chat_template: str | None = None,
    token: str | None = None,
    limits: Limits = Limits(),
) -> None:
    """``lmppo serve-rm``: listen first (a taken port is said before minutes of loading), load the reward
    model, serve until Ctrl-C, one access-log line per request on stderr."""
    listening = _listen(host, port)
    scorer, identity = load_scorer(model_path, batch_size, chat_template)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    bound = listening.getsockname()[1]
    print(f"scoring with {model_path} on http://{host}:{bound}/score (reward.url); GET /health; Ctrl-C stops")
    if not token and host not in ("127.0.0.1", "localhost", "::1"):
        warn(
            f"serve-rm listens on {host} without a token: anyone who reaches this port can score with the model "
            "and queue work on it; set --token (or LMPPO_REWARD_TOKEN) on the server and for its clients"
        )
    uvicorn_server(reward_app(scorer, identity, limits, token), limits).run(sockets=[listening])


def _listen(host: str, port: int):
    """A listening socket on ``host:port`` (port 0: any free one)."""
    import socket

    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host, port), family=family, backlog=1024)
    except OSError as err:
        raise LmppoError(f"cannot listen on {host}:{port} ({err}); choose another --host or --port") from None
