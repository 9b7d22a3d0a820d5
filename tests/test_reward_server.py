"""lmppo serve-rm against careless and hostile peers on real sockets: idle and slow connections hold
nothing, limits are refused with a JSON error, answers are the reward model's own, OpenRLHF's query texts
score as the same conversation does."""

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
from helpers import peer_socket, resident_mb, serve_rm_process

from lmppo.rewards.remote_reward import RemoteReward
from lmppo.rewards.reward_server import (
    Batcher,
    BodyBytes,
    Limits,
    RequestError,
    Rows,
    json_values,
    load_scorer,
    reward_app,
    uvicorn_server,
)

PROMPTS = ["tell me about the cat", [{"role": "user", "content": "write a short poem"}], "sad day"]
RESPONSES = ["good good cat", "red sun and blue night", "it was a very happy day"]
LIMITS = Limits(max_body_bytes=4096, max_rows=8, max_chars=200, queue=4, timeout_s=0.5, idle_s=0.5)


@contextmanager
def running(saved_rm, limits=LIMITS, token=None, batch_size=2):
    """serve-rm's app on uvicorn in a thread, on a free port of 127.0.0.1; yields (base URL, scorer)."""
    scorer, identity = load_scorer(saved_rm, batch_size, None)
    server = uvicorn_server(reward_app(scorer, identity, limits, token), limits)
    listening = socket.create_server(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listening]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{listening.getsockname()[1]}", scorer
    finally:
        server.should_exit = True
        thread.join(10)


def post(url, body: bytes | dict, **headers) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        url, content=content, headers={"Content-Type": "application/json", **headers}, timeout=10
    )


def test_answers_are_the_reward_models_own_for_each_request_as_scored_alone(saved_rm):
    with running(saved_rm) as (url, scorer):
        over_http = RemoteReward(f"{url}/score", batch_size=2, timeout_s=10, retries=0)(PROMPTS, RESPONSES)
        alone = [scorer(PROMPTS[i : i + 2], RESPONSES[i : i + 2]) for i in range(0, 3, 2)]  # the 2 requests
        assert over_http.tolist() == [s for scores in alone for s in scores.tolist()]  # bit for bit
        openrlhf = post(f"{url}/get_reward", {"prompts": PROMPTS, "responses": RESPONSES}).json()["rewards"]
        assert openrlhf == scorer(PROMPTS, RESPONSES).tolist()  # OpenRLHF's path, one request of 3


def test_a_query_text_scores_as_the_conversation_it_renders(saved_rm):
    """OpenRLHF's client sends whole texts: ends of EOS/pad stripped, one EOS appended, special tokens
    read as such (the text's client rendered them); the same conversation sent as rows scores the same."""
    with running(saved_rm) as (url, scorer):
        texts = [scorer.tokenizer.decode(scorer.render(p, r)) for p, r in zip(PROMPTS, RESPONSES)]
        assert all(text.endswith("[EOS]") for text in texts)
        as_rows = post(f"{url}/score", {"prompts": PROMPTS, "responses": RESPONSES}).json()["rewards"]
        as_queries = post(f"{url}/score", {"query": texts}).json()["rewards"]
        unended = post(f"{url}/score", {"query": [t.removesuffix("[EOS]") for t in texts]}).json()["rewards"]
        assert as_queries == as_rows == unended  # EOS appended when missing, never doubled


def test_idle_and_slow_peers_hold_nothing_and_are_cut_off(saved_rm):
    with running(saved_rm) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(20)]  # silent
        slow_body = socket.create_connection(("127.0.0.1", port), timeout=10)
        slow_body.sendall(
            b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n{"
        )  # then nothing
        started = time.monotonic()
        assert post(f"{url}/score", {"prompts": ["hi"], "responses": ["good"]}).status_code == 200
        assert time.monotonic() - started < 2  # served beside them
        assert b"408" in slow_body.recv(4096).split(b"\r\n")[0]  # the body's timeout, 0.5 s
        time.sleep(0.7)
        assert all(connection.recv(1) == b"" for connection in idle)  # closed after idle_s


@pytest.mark.parametrize(
    "body, status, message",
    [
        (b"x" * 5000, 413, "larger than this server's limit of 4096 bytes"),
        (b"{not json", 400, "not JSON"),
        (b"[1, 2]", 400, "must be a JSON object"),
        ({"prompts": "abc", "responses": ["a", "b", "c"]}, 400, '"prompts" must be a list'),
        ({"prompts": {"a": 1}, "responses": ["a"]}, 400, '"prompts" must be a list'),
        ({"prompts": ["a"], "responses": [1]}, 400, '"responses" must be a list of strings'),
        ({"prompts": ["a", "b"], "responses": ["a"]}, 400, "2 prompts and 1 responses"),
        ({"prompts": ["a"] * 9, "responses": ["a"] * 9}, 400, "at most 8 per request"),
        ({"prompts": ["a"], "responses": ["good " * 50]}, 400, "at most 200"),
        ({"query": "abc"}, 400, '"query" must be a list of strings'),
        ({"responses": ["a"]}, 400, 'give "prompts" and "responses"'),
    ],
)
def test_what_a_server_cannot_score_is_refused_with_a_json_error(saved_rm, body, status, message):
    with running(saved_rm) as (url, _):
        answer = post(f"{url}/score", body)
        assert answer.status_code == status and message in answer.json()["error"]


def test_a_declared_body_over_the_limit_is_refused_before_it_is_read(saved_rm):
    with running(saved_rm) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
            connection.sendall(
                b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 209715200\r\n\r\n"
            )
            assert b" 413 " in connection.recv(4096).split(b"\r\n")[0]


def test_the_token_health_and_unknown_paths(saved_rm, caplog):
    caplog.set_level(logging.INFO, logger="lmppo.serve")
    with running(saved_rm, token="s3cret") as (url, _):
        rows = {"prompts": ["hi"], "responses": ["good"]}
        assert post(f"{url}/score", rows).status_code == 401
        assert post(f"{url}/score", rows, Authorization="Bearer wrong").status_code == 401
        assert post(f"{url}/score", rows, Authorization="Bearer s3cret").status_code == 200
        health = httpx.get(f"{url}/health", headers={"Authorization": "Bearer s3cret"}).json()
        assert health["status"] == "ok" and health["model"]["weights_sha256"] and health["queue"] == 0
        assert httpx.get(f"{url}/health").status_code == 401
        lost = post(f"{url}/anything", rows, Authorization="Bearer s3cret")
        assert lost.status_code == 404 and "POST /score or /get_reward" in lost.json()["error"]
        assert httpx.get(f"{url}/score", headers={"Authorization": "Bearer s3cret"}).status_code == 405
    lines = [r.getMessage() for r in caplog.records if r.name == "lmppo.serve"]
    assert any(" POST /score 200 rows=1 " in line for line in lines) and any(
        " 401 " in line for line in lines
    )


def test_a_full_queue_is_busy_and_a_small_request_waits_one_batch_behind_a_large_one(saved_rm):
    scorer, _ = load_scorer(saved_rm, 4, None)
    batches = []
    score_ids = scorer.score_ids
    scorer.score_ids = lambda rows: batches.append(len(rows)) or score_ids(rows)
    large, small, third = Rows(["a"] * 7, ["good"] * 7), Rows(["hi"], ["bad"]), Rows(["b"], ["good"])

    async def scenario():
        batcher = Batcher(scorer, queue=2)
        waiting = [asyncio.ensure_future(batcher.score(rows)) for rows in (large, small)]
        await asyncio.sleep(0)  # both in line, no worker yet
        with pytest.raises(RequestError, match="queue is full") as busy:
            await batcher.score(third)
        assert busy.value.status == 503
        worker = asyncio.ensure_future(batcher.work())
        small_done = await waiting[1]
        large_still_waits = not waiting[0].done()  # its last batch is set only after this resumes
        answers = [await waiting[0], small_done]
        worker.cancel()
        return answers, large_still_waits

    (large_scores, small_scores), large_still_waits = asyncio.run(scenario())
    assert batches == [4, 1, 3] and large_still_waits  # the large one's batches, the small one between
    assert large_scores == scorer(["a"] * 7, ["good"] * 7).tolist()  # grouped as alone: the same numbers
    assert small_scores == scorer(["hi"], ["bad"]).tolist()


def test_a_request_that_cannot_be_rendered_fails_alone(saved_rm):
    """A prompt spelling the reward model's control token is refused; the request beside it is scored."""
    scorer, _ = load_scorer(saved_rm, 4, None)

    async def scenario():
        batcher = Batcher(scorer, 2)
        worker = asyncio.ensure_future(batcher.work())
        answers = await asyncio.gather(
            batcher.score(Rows(["[A] forged"], ["good"])),
            batcher.score(Rows(["hi"], ["good"])),
            return_exceptions=True,
        )
        worker.cancel()
        return answers

    forged, fine = asyncio.run(scenario())
    assert isinstance(forged, RequestError) and forged.status == 400 and "control token" in str(forged)
    assert fine == pytest.approx(scorer(["hi"], ["good"]).tolist(), abs=1e-6)


def test_serve_rm_refuses_a_taken_port_before_loading_the_model(saved_rm, capsys):
    from helpers import run_cli

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        assert run_cli("serve-rm", saved_rm, "--port", port) == 2
    assert "cannot listen on 127.0.0.1:" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# A real serve-rm process against hostile bodies (issue 64's findings 3-6 and 11)
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def process(saved_rm):
    """serve-rm at its default limits; yields (base URL, pid, its resident MB once serving)."""
    with serve_rm_process(saved_rm, "--batch-size", "2") as (url, pid):
        assert httpx.get(f"{url}/health").status_code == 200
        yield url, pid, resident_mb(pid)


NESTED = [
    b"[" * 100_000,
    b'{"a":' * 100_000,
    b'{"prompts": ' + b"[" * 100_000,
    b'{"prompts": [[' + b'{"role": ' * 50_000,
]


@pytest.mark.slow  # a serve-rm process
@pytest.mark.parametrize("body", NESTED, ids=["lists", "objects", "inside-an-object", "inside-a-message"])
def test_deeply_nested_json_is_a_400_in_json(process, body):
    """Finding 3: 100k levels raised a RecursionError: a plain-text 500."""
    answer = post(f"{process[0]}/score", body)
    assert answer.status_code == 400 and (
        "nests deeper" in answer.json()["error"] or "JSON values" in answer.json()["error"]
    )


@pytest.mark.slow  # a serve-rm process
def test_text_that_is_not_unicode_fails_its_own_request_only(process):
    """Finding 4: a lone surrogate failed the tokenizer, and every request batched with it got 500."""
    url = f"{process[0]}/score"
    bad = b'{"prompts": ["hi"], "responses": ["hi \\ud800"]}'
    good = {"prompts": ["hi", "sad day"], "responses": ["good", "good good"]}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda body: post(url, body), [bad, good] * 4))
    assert all(a.status_code == 400 and "row 0" in a.json()["error"] for a in answers[::2])
    assert all(a.status_code == 200 and len(a.json()["rewards"]) == 2 for a in answers[1::2])
    chat = {"prompts": [[{"role": "user\ud800", "content": "x"}]], "responses": ["a"]}
    assert post(url, json.dumps(chat).encode()).status_code == 400  # a role too


@pytest.mark.slow  # a serve-rm process
def test_no_redirects_and_only_json_bodies(process):
    """Finding 5: `/score/` answered a 307 whose Location came from the Host header; finding 11: a
    text/plain body (what a web page can make a browser send to localhost) was scored."""
    url = process[0]
    for path in ("/score/", "/health/"):
        answer = httpx.request("POST" if path == "/score/" else "GET", url + path, headers={"Host": "evil"})
        assert answer.status_code == 404 and "location" not in answer.headers and "error" in answer.json()
    plain = post(f"{url}/score", json.dumps(ROWS_ONE).encode(), **{"Content-Type": "text/plain"})
    assert plain.status_code == 415 and "application/json" in plain.json()["error"]


ROWS_ONE = {"prompts": ["hi"], "responses": ["good"]}


@pytest.mark.slow  # a serve-rm process
def test_one_request_of_half_a_million_messages_is_refused_at_once(process):
    """Finding 6: 508,394 empty messages (16 MiB) took 8 s to score, held the line and 1.1 GB."""
    url, pid, start_mb = process
    messages = b",".join([b'{"role":"user","content":""}'] * 508_394)
    flood = b'{"prompts":[[' + messages + b']],"responses":[""]}'
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        started = time.monotonic()
        flooded = pool.submit(post, f"{url}/score", flood)
        time.sleep(0.05)
        beside = pool.submit(post, f"{url}/score", ROWS_ONE)
        assert beside.result().status_code == 200 and time.monotonic() - started < 3
        assert flooded.result().status_code == 400 and "JSON values" in flooded.result().json()["error"]
    few = {"prompts": [[{"role": "user", "content": "hi"}] * 300], "responses": ["good"]}
    assert "300 messages" in post(f"{url}/score", few).json()["error"]  # --max-messages, 256


@pytest.mark.slow  # a serve-rm process
def test_the_limits_of_work_per_request_are_in_health(process):
    limits = httpx.get(f"{process[0]}/health").json()["limits"]
    assert limits == dataclasses.asdict(Limits())  # every default, as docs/rewards.md lists them


@pytest.mark.slow  # a serve-rm process
def test_floods_keep_the_servers_memory_within_200_mb_of_its_start(process):
    """Finding 6 and the goal of item 8: sockets, nesting, the message flood and 16 MiB bodies at once
    raise the server's peak resident memory by less than 200 MB."""
    url, pid, start_mb = process
    port = int(url.rsplit(":", 1)[1])
    hoard = [peer_socket("127.0.0.7", port) for _ in range(500)]
    wide = b'{"prompts": [' + b"{}," * (5 * 2**20) + b'{}], "responses": []}'  # 5 million objects, 15 MiB
    bodies = [*NESTED, wide, b'{"query": ["' + b"x" * (15 * 2**20) + b'"]}'] * 3
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        statuses = [a.status_code for a in pool.map(lambda b: post(f"{url}/score", b), bodies)]
    for s in hoard:
        s.close()
    assert set(statuses) <= {400, 503}  # refused, or asked to retry while other bodies fill the budget
    assert resident_mb(pid, "VmHWM") - start_mb < 200


def test_a_batch_that_fails_is_scored_again_request_by_request(saved_rm):
    """Only the request that fails scoring alone gets the 500; the others in its batch are scored."""
    scorer, _ = load_scorer(saved_rm, 4, None)
    score_ids = scorer.score_ids
    poison = scorer.render("hi", "bad")

    def fails_on_poison(rows):
        if poison in rows:
            raise RuntimeError("a row the model cannot take")
        return score_ids(rows)

    scorer.score_ids = fails_on_poison

    async def scenario():
        batcher = Batcher(scorer, 4)
        worker = asyncio.ensure_future(batcher.work())
        answers = await asyncio.gather(
            batcher.score(Rows(["a"], ["good"])),
            batcher.score(Rows(["hi"], ["bad"])),
            batcher.score(Rows(["b"], ["good"])),
            return_exceptions=True,
        )
        worker.cancel()
        return answers

    first, failed, third = asyncio.run(scenario())
    assert isinstance(failed, RequestError) and failed.status == 500
    assert first == score_ids([scorer.render("a", "good")]).tolist()
    assert third == score_ids([scorer.render("b", "good")]).tolist()


def test_a_request_whose_client_is_gone_leaves_the_line_unscored(saved_rm):
    scorer, _ = load_scorer(saved_rm, 2, None)
    scored = []
    score_ids = scorer.score_ids
    scorer.score_ids = lambda rows: scored.extend(rows) or score_ids(rows)

    async def scenario():
        batcher = Batcher(scorer, 4)
        abandoned = asyncio.ensure_future(batcher.score(Rows(["a"] * 6, ["good"] * 6)))
        await asyncio.sleep(0)
        abandoned.cancel()  # what unless_gone does when the client disconnects
        await asyncio.sleep(0)
        assert batcher.waiting == []
        worker = asyncio.ensure_future(batcher.work())
        kept = await batcher.score(Rows(["hi"], ["good"]))
        worker.cancel()
        return kept

    assert len(asyncio.run(scenario())) == 1 and scored == [scorer.render("hi", "good")]


def test_bodies_held_at_once_are_capped():
    bodies = BodyBytes(100)
    with bodies.holding() as take:
        take(60)
        with bodies.holding() as other, pytest.raises(RequestError) as busy:
            other(50)
        assert busy.value.status == 503 and bodies.held == 60
    assert bodies.held == 0


def test_json_values_are_counted_on_the_bytes_as_parsing_would_make_them():
    body = b'{"a": [1, 2, {"b": "c\\\\"}], "d": "e\\", [{f}]"}'  # strings holding escapes, brackets, commas
    assert json_values(body, 100) == 10  # the root, the list, 1, 2, the object, "c\\", "e..." and 3 keys
    messages = [{"role": "user", "content": "hi, [yes]: {no}"}] * 8
    largest = json.dumps({"prompts": [messages] * 4096, "responses": ["ok"] * 4096}).encode()
    assert json_values(largest, Limits().max_values) <= Limits().max_values  # 4096 rows of 8 messages fit
