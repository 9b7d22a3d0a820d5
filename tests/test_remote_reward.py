"""The reward.url client against servers on 127.0.0.1, polite and not: it never hangs past its deadline,
never trains on numbers nobody computed for its responses, and retries only what a retry may mend."""

import functools
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
import zlib

import pytest
import yaml
from helpers import comparable, fake_server, run_cli, serving

from lmppo.errors import LmppoError
from lmppo.inputs.config import load_config
from lmppo.rewards import remote_reward
from lmppo.rewards.remote_reward import RemoteReward
from lmppo.training.metrics import read_metrics

PROMPTS = ["say good", [{"role": "user", "content": "say good twice"}], "hi"]
RESPONSES = ["good", "good good", "no"]


def client(url, **kwargs):
    return RemoteReward(url, **{"batch_size": 2, "timeout_s": 5.0, "retries": 2, **kwargs})


@pytest.fixture(autouse=True)
def short_pauses(monkeypatch):
    monkeypatch.setattr(remote_reward, "FIRST_PAUSE_S", 0.01)


def raw_server(answer):
    """A server that reads each request whole, then lets ``answer(connection)`` write raw bytes (or
    nothing, or slowly); returns its URL and the (head, JSON body) of each request it got."""
    listening = socket.create_server(("127.0.0.1", 0))
    requests = []

    def handle(connection):
        with connection:
            head = b""
            while b"\r\n\r\n" not in head:
                head += connection.recv(65536)
            length = int(
                next(
                    line.split(b":")[1]
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
            )
            body = head.split(b"\r\n\r\n", 1)[1]
            while len(body) < length:
                body += connection.recv(65536)
            requests.append((head.split(b"\r\n\r\n")[0], json.loads(body)))
            try:
                answer(connection)
            except OSError:  # the client gave up: what the deadline tests want
                pass

    def accept():
        while True:
            connection, _ = listening.accept()
            threading.Thread(target=handle, args=(connection,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return f"http://127.0.0.1:{listening.getsockname()[1]}/score", requests


def head(status="200 OK", length=None, extra=b""):
    size = b"" if length is None else b"Content-Length: %d\r\n" % length
    return b"HTTP/1.1 " + status.encode() + b"\r\n" + size + extra + b"\r\n"


def encoded(body, encoding="gzip"):
    """A whole answer whose body is sent as is under ``Content-Encoding: encoding``."""
    return head(length=len(body), extra=b"Content-Encoding: " + encoding.encode() + b"\r\n") + body


@functools.cache
def zeros_gzip(mib):
    """``mib`` MiB of zeros as one gzip member, in about a thousandth of that: one MiB's deflate blocks, cut
    at full flushes, repeat byte for byte (compressing the zeros themselves would take seconds)."""
    zeros, deflate = bytes(2**20), zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    modes = (zlib.Z_FULL_FLUSH, zlib.Z_FULL_FLUSH, zlib.Z_FINISH)
    first, again, last = (deflate.compress(zeros) + deflate.flush(mode) for mode in modes)
    crc = 0
    for _ in range(mib):
        crc = zlib.crc32(zeros, crc)
    return first + again * (mib - 2) + last[:-8] + struct.pack("<II", crc, (mib * 2**20) % 2**32)


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
        ((200, {"rewards": [True, 1.0]}), "not a JSON object"),  # a boolean is no number here
        ((200, b'{"rewards": [Infinity, 1.0]}'), "not a JSON object"),
        ((200, b'{"rewards": [1e400, 1.0]}'), "not a JSON object"),
        ((200, b'{"rewards": [1e308, 1.0]}'), "not a JSON object"),  # finite, but no float32
        (
            (200, b'{"rewards": [1' + b"0" * 400 + b", 1.0]}"),
            "not a JSON object",
        ),  # an int past float's range
        ((400, b"prompts missing"), "refused the request: HTTP 400 prompts missing"),
        ((401, b"token"), "set its token in the environment variable LMPPO_REWARD_TOKEN"),
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


@pytest.mark.parametrize("trickled", ["head", "body"])
def test_a_server_trickling_its_answer_is_cut_at_the_deadline_of_the_whole_request(trickled):
    """Each byte comes before any read would time out, so only a deadline for the whole request holds."""
    answer = head(length=40) + b'{"rewards": [1.0, 2.0]}' + b" " * 17

    def trickle(connection):
        start = 0 if trickled == "head" else len(head(length=40))
        connection.sendall(answer[:start])
        for byte in answer[start:]:
            connection.sendall(bytes([byte]))
            time.sleep(0.1)

    url, requests = raw_server(trickle)
    started = time.monotonic()
    with pytest.raises(LmppoError, match="no whole answer within reward.url_timeout_s=0.5 s"):
        client(url, timeout_s=0.5, retries=1)(PROMPTS[:2], RESPONSES[:2])
    assert time.monotonic() - started < 1.6 and len(requests) == 2  # 2 tries of 0.5 s, nothing more


@pytest.mark.parametrize("status", ["301 Moved Permanently", "302 Found", "303 See Other", "307 Temporary"])
def test_a_redirect_is_refused_never_followed(status):
    elsewhere, asked = raw_server(lambda c: c.sendall(head(length=27) + b'{"rewards": [9.0, 9.0]}    '))
    url, _ = raw_server(lambda c: c.sendall(head(status, 0, b"Location: " + elsewhere.encode() + b"\r\n")))
    with pytest.raises(LmppoError, match=f"a redirect to '{elsewhere}'; lmppo follows none"):
        client(url)(PROMPTS[:2], RESPONSES[:2])
    assert asked == []  # the other server never saw a request, and its 9.0s were never taken


@pytest.mark.parametrize(
    "broken",
    [
        head(length=100) + b'{"rewards": [1.0',  # the connection closes mid-body
        b"HTTP/1.1 two hundred OK\r\n\r\n",  # a bad status line
        b"",  # closed before any answer
        encoded(b"\x1f\x8b\x08\x00 not gzip at all"),
        encoded(zlib.compress(b'{"rewards": [1.0, 2.0]}', wbits=31)[:-9]),  # its last block and trailer lost
    ],
    ids=["closed mid-body", "bad status line", "closed at once", "corrupt gzip", "cut gzip"],
)
def test_a_broken_answer_is_retried_then_one_clear_error(broken):
    url, requests = raw_server(lambda c: c.sendall(broken))
    with pytest.raises(LmppoError, match=f"reward.url {url} did not answer .* in 3 tries"):
        client(url)(PROMPTS[:2], RESPONSES[:2])
    assert len(requests) == 3


def test_an_answer_larger_than_its_rows_can_need_is_refused_without_reading_it_all():
    url, _ = raw_server(lambda c: c.sendall(head(length=10**8) + b" " * 2**20))
    with pytest.raises(LmppoError, match="answered more than 65536 bytes for 2 rows"):
        client(url)(PROMPTS[:2], RESPONSES[:2])


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_the_answer_is_asked_for_plain_and_one_layer_of_gzip_or_deflate_is_read(encoding):
    scores = b'{"rewards": [1.0, 2.0]}'
    body = zlib.compress(scores, wbits=31 if encoding == "gzip" else zlib.MAX_WBITS)
    url, requests = raw_server(lambda c: c.sendall(encoded(body, encoding)))
    assert client(url)(PROMPTS[:2], RESPONSES[:2]).tolist() == [1.0, 2.0]
    assert b"accept-encoding: identity" in requests[0][0].lower()


@pytest.mark.parametrize(
    "layers, message",
    [(1, "answered more than 65536 bytes for 2 rows"), (2, "answered in Content-Encoding 'gzip, gzip'")],
)
def test_a_gzip_bomb_is_refused_before_it_fills_memory(layers, message):
    """1 GiB of zeros in 1 MiB of gzip, or in 2 KiB of gzip of gzip: decoded whole it took a trainer to
    2.5 GB; decoded as it arrives, never past the answer's cap, it takes a few MiB at most."""
    bomb = zeros_gzip(1024)
    if layers == 2:
        bomb = zlib.compress(bomb, 9, wbits=31)
    url, _ = raw_server(lambda c: c.sendall(encoded(bomb, ", ".join(["gzip"] * layers))))
    tracemalloc.start()
    try:
        with pytest.raises(LmppoError, match=message):
            client(url)(PROMPTS[:2], RESPONSES[:2])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 * 2**20  # httpx's first import included; decoded whole, 150 MB and 2.5 GB


@pytest.mark.parametrize(
    "token, flaw",
    [
        ("s3cret-XYZ\r", "a carriage return (\\r) at its end"),
        ("s3cret\nXYZ", "a newline (\\n) at character 7 of 10"),
        ("s3cret XYZ", "a space at character 7"),
        ("s3cret\x1bXYZ", "a control character at character 7"),
        ("s3cr\u00e9tXYZ", "a non-ASCII character at character 5"),
    ],
)
def test_a_token_no_header_can_carry_is_refused_before_any_request_never_shown(monkeypatch, token, flaw):
    url, requests = raw_server(lambda c: c.sendall(head(length=23) + b'{"rewards": [1.0, 2.0]}'))
    monkeypatch.setenv("MY_RM_TOKEN", token)
    with pytest.raises(LmppoError, match="the environment variable MY_RM_TOKEN") as err:
        client(url, token_env="MY_RM_TOKEN")
    assert flaw in str(err.value) and "s3cr" not in str(err.value) and "XYZ" not in str(err.value)
    assert requests == []


def test_a_url_no_request_can_be_sent_to_is_one_error_never_a_traceback(run_files, capsys):
    with pytest.raises(LmppoError, match="is no address a request can be sent to .*OverflowError"):
        client("http://127.0.0.1:70000/score")(PROMPTS[:2], RESPONSES[:2])  # what the config check refuses
    assert run_cli("ppo", str(run_files), "reward={url: 'http://127.0.0.1:70000/score'}") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "has the port '70000'" in " ".join(err.split())


def test_no_proxy_from_the_environment_and_the_token_from_its_variable(monkeypatch):
    url, requests = raw_server(lambda c: c.sendall(head(length=23) + b'{"rewards": [1.0, 2.0]}'))
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # a dead proxy: were it used, this would fail
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("MY_RM_TOKEN", "s3cret")
    assert client(url, token_env="MY_RM_TOKEN")(PROMPTS[:2], RESPONSES[:2]).tolist() == [1.0, 2.0]
    assert b"authorization: bearer s3cret" in requests[0][0].lower()


@pytest.mark.parametrize(
    "url, message",
    [
        ("file:///etc/passwd", "is not an http(s) URL"),
        ("ftp://host/score", "is not an http(s) URL"),
        ("http://user:pw@127.0.0.1:8000/score", "holds credentials"),
        ("http://127.0.0.1:70000/score", "has the port '70000', which no server listens on"),
        ("http://127.0.0.1:port/score", "has the port 'port'"),
        ("http:///score", "names no host"),
        ("http://user:pw@[::1/score", "is no URL (Invalid IPv6 URL)"),
    ],
)
def test_only_plain_http_urls_without_credentials_are_a_reward_url(run_files, url, message):
    with pytest.raises(LmppoError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        load_config(run_files, [f"reward={{url: '{url}'}}"])
    assert "pw" not in str(err.value)  # never echoed


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


@pytest.mark.slow
def test_a_signal_while_a_request_hangs_stops_the_run_at_once_keeping_the_last_checkpoint(run_files):
    """The server answers the pre-flight and step 1, then never again: SIGTERM during step 2's request
    ends the run within seconds (not after url_timeout_s and its retries), with step 1's checkpoint."""
    step_1 = run_files.parent / "run" / "checkpoints" / "step-000001"
    hanging = []

    def answer_then_hang(connection):
        if step_1.exists():  # step 2's request: never answered
            hanging.append(1)
            time.sleep(600)
        scores = json.dumps({"rewards": [1.0, 0.0]}).encode()
        connection.sendall(head(length=len(scores)) + scores)

    url, _ = raw_server(answer_then_hang)
    config = yaml.safe_load(run_files.read_text())
    config["reward"] = {"url": url, "batch_size": 2, "url_timeout_s": 300, "url_retries": 3}
    config["run"].update(steps=5, checkpoint_every=1)
    (run_files.parent / "hang.yaml").write_text(yaml.safe_dump(config))
    run = subprocess.Popen(
        [sys.executable, "-m", "lmppo", "ppo", str(run_files.parent / "hang.yaml"), "--quiet"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    deadline = time.monotonic() + 120
    while not hanging and time.monotonic() < deadline and run.poll() is None:
        time.sleep(0.1)
    stopped_at = time.monotonic()
    run.send_signal(signal.SIGTERM)
    out, _ = run.communicate(timeout=60)
    assert run.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert time.monotonic() - stopped_at < 10
    assert "stopped at once" in out and "step-000001, is intact" in out and "Traceback" not in out
    assert [r["step"] for r in read_metrics(run_files.parent / "run")] == [0, 1]
