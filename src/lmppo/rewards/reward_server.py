"""``lmppo serve-rm``: a reward model on a port, for ``reward.url`` (its client is
:mod:`lmppo.rewards.remote_reward`).

An ASGI app (Starlette) on uvicorn (``pip install 'lmppo[serve]'``), made to face careless or hostile peers:
- ``POST /score`` (also ``/get_reward``, OpenRLHF's path) takes ``{"prompts": [...], "responses": [...]}``,
  rendered with the reward model's own tokenizer and chat template (no text becomes a control token), or
  OpenRLHF's ``{"query": [whole texts]}``, rendered as OpenRLHF's server does; it answers
  ``{"rewards": [...]}``. ``GET /health`` says which model serves, on what device, the queue's depth and
  every limit. Any other path is a JSON 404 (no redirects).
- Every refusal is a JSON ``{"error": ...}`` (:class:`Limits`, docs/rewards.md): a body that is not
  ``application/json`` (415), too large (413), too slow to arrive (408), not JSON, nested too deep, with too
  many JSON values, rows, messages or characters, or with text that is not valid Unicode (400), a full queue
  (503). A body is checked whole before its rows join a batch, so no request can fail another's.
- Below the app (:mod:`lmppo.rewards.connections`): a whole request head within ``idle_s`` however it
  trickles in, and caps on open connections per peer address and in all.
- Queued requests' rows are scored together in the model's batches, one at a time, off the event loop; a
  request is rendered a batch at a time, so a large one holds the line for about one batch; a request
  whose client has gone is dropped from the line; a batch that fails is scored again request by request,
  so only the request that fails it gets the 500.
- An optional bearer token (``--token`` or ``LMPPO_REWARD_TOKEN``); 127.0.0.1 unless told otherwise.
- One access-log line per request: client, method, path, status, rows, milliseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

from lmppo.errors import LmppoError, warn
from lmppo.inputs.data import as_messages
from lmppo.rewards.connections import Gate, guarded_protocol
from lmppo.rewards.limits import Limits
from lmppo.rewards.scoring import RewardModelScorer

log = logging.getLogger("lmppo.serve")
PATHS = ("/score", "/get_reward")  # lmppo's, and OpenRLHF's remote reward model's


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

    def rendered(self, scorer: RewardModelScorer, start: int, stop: int) -> list[list[int]]:
        """Rows ``start:stop`` as the reward model's token ids."""
        if self.queries is not None:
            return [scorer.render_query(text) for text in self.queries[start:stop]]
        pairs = zip(self.prompts[start:stop], self.responses[start:stop], strict=True)
        return [scorer.render(prompt, response) for prompt, response in pairs]

    def texts(self) -> Iterator[list[str]]:
        """Each row's texts: its query, or its response and its prompt's roles and contents."""
        if self.queries is not None:
            yield from ([query] for query in self.queries)
            return
        for prompt, response in zip(self.prompts, self.responses, strict=True):
            messages = as_messages(prompt)
            yield [response, *(m["content"] for m in messages), *(m["role"] for m in messages)]


# A JSON string on the wire, escapes included: what is left without them is the body's structure.
JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


def json_values(body: bytes | bytearray, limit: int) -> int:
    """How many values parsing ``body`` would create, at most, counted on its bytes before any is made
    (a 16 MiB body of ``{},`` would make 5 million objects): the root, each container's elements or
    members (its commas, plus one), each member's key. Above ``limit`` the count may stop early."""
    strings = (body.count(b'"') - body.count(b'\\"')) // 2  # at least this many, each a value or a key
    if strings > limit:  # too many to be worth stripping
        return strings
    structure = JSON_STRING.sub(b"", body)
    containers = structure.count(b"[") + structure.count(b"{")
    return 1 + containers + structure.count(b",") + structure.count(b":")


def parse_rows(body: bytes | bytearray, limits: Limits) -> Rows:
    """A request's rows, checked whole (shapes of the wire format, limits, valid text) before any of them
    reaches the model."""
    values = json_values(body, limits.max_values)
    if values > limits.max_values:
        raise RequestError(
            400,
            f"the body would make more than {limits.max_values} JSON values (strings, numbers, lists, objects), "
            "this server's limit; send fewer rows per request",
        )
    try:
        request = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RequestError(400, "the body is not JSON") from None
    except RecursionError:
        raise RequestError(400, "the body nests deeper than any request of the wire format") from None
    if not isinstance(request, dict):
        raise RequestError(400, 'the request must be a JSON object: {"prompts": [...], "responses": [...]}')
    if "query" in request:
        rows = Rows(queries=_texts(request["query"], "query"))
    else:
        if "prompts" not in request or "responses" not in request:
            raise RequestError(400, 'give "prompts" and "responses" (or OpenRLHF\'s "query")')
        rows = Rows(_prompts(request["prompts"], limits), _texts(request["responses"], "responses"))
        if len(rows.prompts) != len(rows.responses):
            raise RequestError(
                400,
                f"{len(rows.prompts)} prompts and {len(rows.responses)} responses; give one prompt per response",
            )
    if len(rows) > limits.max_rows:
        raise RequestError(400, f"{len(rows)} rows; this server takes at most {limits.max_rows} per request")
    _check_texts(rows, limits)
    return rows


def _check_texts(rows: Rows, limits: Limits) -> None:
    """Characters per row and per request within the limits, and every text valid Unicode (JSON's
    ``\ud800`` escape makes a lone surrogate no tokenizer can encode)."""
    total = 0
    for i, texts in enumerate(rows.texts()):
        chars = sum(map(len, texts))
        if chars > limits.max_chars:
            raise RequestError(
                400, f"row {i} has {chars} characters; this server takes at most {limits.max_chars} per row"
            )
        if not all(text.isascii() or _is_unicode(text) for text in texts):
            raise RequestError(400, f"row {i} holds text that is not valid Unicode (a lone surrogate escape)")
        total += chars
    if total > limits.max_request_chars:
        raise RequestError(
            400,
            f"{total} characters in all; this server takes at most {limits.max_request_chars} per request",
        )


def _is_unicode(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _texts(value, key: str) -> list[str]:
    if not (isinstance(value, list) and all(isinstance(text, str) for text in value)):
        raise RequestError(400, f'"{key}" must be a list of strings')
    return value


def _prompts(value, limits: Limits) -> list:
    """Each prompt a string or a list of {"role", "content"} messages with string content."""

    def is_message(m) -> bool:
        return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)

    if not (
        isinstance(value, list)
        and all(
            isinstance(p, str) or (isinstance(p, list) and p and all(is_message(m) for m in p)) for p in value
        )
    ):
        raise RequestError(
            400, '"prompts" must be a list of strings or of lists of {"role", "content"} messages'
        )
    longest = max((len(p) for p in value if isinstance(p, list)), default=0)
    if longest > limits.max_messages:
        raise RequestError(
            400, f"a conversation of {longest} messages; this server takes at most {limits.max_messages}"
        )
    return value


@dataclass(eq=False)
class Job:
    """A request waiting for its scores: its rows, those rendered so far, and the scores so far."""

    rows: Rows
    answer: asyncio.Future
    ids: list[list[int]] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    error: RequestError | None = None

    @property
    def left(self) -> int:
        return 0 if self.error else len(self.rows) - len(self.scores)

    def next_rows(self, n: int, scorer: RewardModelScorer) -> list[list[int]]:
        """Its next ``n`` rows' token ids, rendered now: a request is rendered a batch at a time."""
        start = len(self.scores)
        if len(self.ids) < start + n:
            self.ids += self.rows.rendered(scorer, len(self.ids), start + n)
        return self.ids[start : start + n]


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
        try:
            return await job.answer
        except asyncio.CancelledError:  # its client is gone: its rows are not scored
            with contextlib.suppress(ValueError):
                self.waiting.remove(job)
            raise

    async def work(self) -> None:
        while True:
            if not self.waiting:
                self.arrived.clear()
                await self.arrived.wait()
            await asyncio.to_thread(self._score, self._next_batch())
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
        """Score the batch; when it fails, score its requests one by one, so that only a request that fails
        alone gets the error (the model's own failure, out of memory or a bug, fails them all)."""
        rendered = [(job, n, ids) for job, n in batch if (ids := self._render(job, n)) is not None]
        try:
            self._score_rendered(rendered)
        except Exception:
            if len(rendered) > 1:  # alone, each request is scored or is the one that fails
                for one in rendered:
                    with contextlib.suppress(Exception):
                        self._score_rendered([one])
            for job, _, _ in rendered:
                if job.error is None and len(job.scores) < len(job.ids):
                    log.exception("scoring failed")
                    job.error = RequestError(500, "scoring failed on the server; its log says why")

    def _render(self, job: Job, n: int) -> list[list[int]] | None:
        """The job's next rows as token ids, or None when they cannot be rendered (the job fails alone)."""
        try:
            return job.next_rows(n, self.scorer)
        except LmppoError as err:  # a prompt spelling a control token, a template that refuses it, ...
            job.error = RequestError(400, str(err))
        except Exception:
            log.exception("rendering failed")
            job.error = RequestError(500, "rendering the request failed on the server; its log says why")
        return None

    def _score_rendered(self, rendered: list[tuple[Job, int, list[list[int]]]]) -> None:
        scores = self.scorer.score_ids([row for _, _, ids in rendered for row in ids]).tolist()
        for job, n, _ in rendered:
            job.scores, scores = job.scores + scores[:n], scores[n:]

    def _answer_finished(self) -> None:
        for job in [job for job in self.waiting if not job.left]:
            self.waiting.remove(job)
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

    batcher, bodies = Batcher(scorer, limits.queue), BodyBytes(limits.max_bodies_bytes)
    parsing = asyncio.Semaphore(1)  # one body's values in memory at a time

    async def score(request) -> JSONResponse:
        try:
            _authorize(request, token)
            _require_json(request)
            with bodies.holding() as take:
                body = await read_body(request, limits, take)
                async with parsing:
                    rows = await asyncio.to_thread(parse_rows, body, limits)
            del body
            request.state.rows = len(rows)
            return JSONResponse({"rewards": await unless_gone(request, batcher.score(rows))})
        except RequestError as err:
            return JSONResponse({"error": str(err)}, status_code=err.status)

    async def health(request) -> JSONResponse:
        try:
            _authorize(request, token)
        except RequestError as err:
            return JSONResponse({"error": str(err)}, status_code=err.status)
        device = str(next(scorer.token_scores.parameters()).device)
        body = {"status": "ok", "model": identity, "device": device, "batch_size": scorer.batch_size}
        return JSONResponse({**body, "queue": len(batcher.waiting), "limits": dataclasses.asdict(limits)})

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
    app.router.redirect_slashes = False  # `/score/` is unknown, not a redirect built from the Host header
    return AccessLog(app)


def _authorize(request, token: str | None) -> None:
    if token and not hmac.compare_digest(request.headers.get("authorization", ""), f"Bearer {token}"):
        raise RequestError(401, "this server needs its bearer token (Authorization: Bearer ...)")


def _require_json(request) -> None:
    """Only JSON bodies: a web page can make a browser post text/plain to a server on localhost, not JSON."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise RequestError(415, f"send the body as JSON (Content-Type: application/json), not {media_type!r}")


class BodyBytes:
    """The bytes of the bodies being received or parsed, all requests together, held under a cap."""

    def __init__(self, limit: int) -> None:
        self.limit, self.held = limit, 0

    @contextlib.contextmanager
    def holding(self) -> Iterator[Callable[[int], None]]:
        """``take(n)``: hold ``n`` more bytes for this request until the block ends (503 past the cap)."""
        taken = 0

        def take(n: int) -> None:
            nonlocal taken
            if self.held + n > self.limit:
                raise RequestError(503, "the server holds as many request bodies as it takes; retry later")
            self.held, taken = self.held + n, taken + n

        try:
            yield take
        finally:
            self.held -= taken


async def read_body(request, limits: Limits, take: Callable[[int], None]) -> bytearray:
    """The request's body (not copied: it may be 16 MiB), refused when larger than the limit or slower
    than the timeout to arrive."""
    declared = request.headers.get("content-length", "")
    too_large = f"the body is larger than this server's limit of {limits.max_body_bytes} bytes"
    if declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise RequestError(413, too_large)
    body = bytearray()
    try:
        async with asyncio.timeout(limits.timeout_s):
            async for chunk in request.stream():
                body += chunk
                take(len(chunk))
                if len(body) > limits.max_body_bytes:
                    raise RequestError(413, too_large)
    except TimeoutError:
        raise RequestError(408, f"the body did not arrive within {limits.timeout_s:g} s") from None
    return body


async def unless_gone(request, scores: Awaitable[list[float]]) -> list[float]:
    """The scores, unless the client disconnects first: then their request leaves the line (499)."""
    scoring = asyncio.ensure_future(scores)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({scoring, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not scoring.done():
            scoring.cancel()
    if not scoring.done() or scoring.cancelled():
        raise RequestError(499, "the client closed the connection before its scores")
    return scoring.result()


async def _disconnected(request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


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


def uvicorn_server(app, limits: Limits = Limits()):
    """A uvicorn server for ``app`` with the limits' deadlines and connection caps
    (:mod:`lmppo.rewards.connections`); run it with ``server.run(sockets=[...])``."""
    import uvicorn

    gate = Gate(limits.connections, limits.connections_per_client)
    config = uvicorn.Config(
        app,
        http=guarded_protocol(gate, limits.idle_s),
        ws="none",  # no upgrade hands a connection to a protocol without the guards
        timeout_keep_alive=limits.idle_s,
        limit_concurrency=None,  # the gate caps connections per peer; uvicorn's cap would 503 every peer
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
    _allow_open_files(limits.connections + 64)  # the connections, the model's files, the listening socket
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


def _allow_open_files(needed: int) -> None:
    """Raise this process's open-file limit to ``needed`` where the hard limit allows, else say so: past it,
    accepting a connection fails for every peer."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise LmppoError(
            f"serve-rm may keep --connections open, which needs {needed} open files, but this process may open "
            f"at most {hard} (ulimit -Hn); lower --connections or raise the limit"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def _listen(host: str, port: int):
    """A listening socket on ``host:port`` (port 0: any free one)."""
    import socket

    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host, port), family=family, backlog=1024)
    except OSError as err:
        raise LmppoError(f"cannot listen on {host}:{port} ({err}); choose another --host or --port") from None
