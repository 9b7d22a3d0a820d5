"""serve-rm's connection layer against peers that trickle or hoard sockets: a real `lmppo serve-rm`
process, peers on other loopback addresses (127.0.0.0/8 are all this machine)."""

import json
import socket
import threading
import time

import httpx
import pytest
from helpers import peer_socket, serve_rm_process

from lmppo.rewards.connections import Gate
from lmppo.rewards.reward_server import Limits

ROWS = {"prompts": ["hi"], "responses": ["good"]}


@pytest.fixture(scope="module")
def server(saved_rm):
    """serve-rm with a 1 s head deadline and its default connection caps (64 per address, 1024 in all)."""
    with serve_rm_process(saved_rm, "--idle-s", "1", "--timeout-s", "2") as (url, pid):
        yield url, int(url.rsplit(":", 1)[1])


def score(url: str) -> httpx.Response:
    return httpx.post(f"{url}/score", json=ROWS, timeout=10)


def answer_of(connection: socket.socket) -> tuple[int, dict] | None:
    """The status and JSON body the server wrote on ``connection``, or None when it closed it unanswered."""
    data = b""
    while chunk := connection.recv(65536):
        data += chunk
    if not data:
        return None
    head, body = data.split(b"\r\n\r\n", 1)
    return int(head.split()[1]), json.loads(body)


def closed_within(connection: socket.socket, seconds: float) -> bool:
    connection.settimeout(seconds)
    try:
        while connection.recv(1024):
            pass
        return True
    except (TimeoutError, ConnectionResetError) as err:
        return isinstance(err, ConnectionResetError)


@pytest.mark.slow  # a serve-rm process
def test_a_head_trickled_a_byte_at_a_time_is_cut_at_the_deadline(server):
    """Finding 1: each byte used to restart the idle timer, so a trickled head was waited for forever."""
    url, port = server
    peers = [peer_socket("127.0.0.2", port) for _ in range(10)]
    head = b"POST /score HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
    started, cut = time.monotonic(), {}
    for i in range(len(head)):  # a byte every 0.2 s on every connection, until the server hangs up
        for n, peer in enumerate(peers):
            if n not in cut:
                try:
                    peer.sendall(head[i : i + 1])
                except OSError:
                    cut[n] = time.monotonic() - started
        if len(cut) == len(peers) or time.monotonic() - started > 5:
            break
        time.sleep(0.2)
    assert len(cut) == len(peers) and max(cut.values()) < 2.5, cut  # the deadline is 1 s from connecting
    assert score(url).status_code == 200


@pytest.mark.slow  # a serve-rm process
def test_one_peer_holding_500_sockets_denies_no_other_peer(server):
    """Finding 2: 520 idle sockets from anyone filled uvicorn's one cap, and every request got a plain 503."""
    url, port = server
    hoard = [peer_socket("127.0.0.3", port) for _ in range(500)]
    try:
        started = time.monotonic()
        answers = [score(url) for _ in range(5)]
        assert all(a.status_code == 200 for a in answers) and time.monotonic() - started < 5
        refused = [answer_of(s) for s in hoard[64:]]  # past the first 64 of this address
        assert all(r[0] == 429 and "64 connections open" in r[1]["error"] for r in refused)
    finally:
        for s in hoard:
            s.close()


def test_at_the_global_cap_an_idle_connection_makes_room_and_a_busy_server_says_503_in_json(saved_rm):
    from test_reward_server import running

    limits = Limits(connections=8, connections_per_client=4, idle_s=5, timeout_s=5)
    with running(saved_rm, limits) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        idle = [peer_socket(f"127.0.0.{4 + i // 4}", port) for i in range(8)]  # two peers, 4 each: the cap
        time.sleep(0.2)
        assert score(url).status_code == 200  # an idle connection of one of them was closed for it
        assert sum(closed_within(s, 0.5) for s in idle) >= 1
        for s in idle:
            s.close()
        busy = [peer_socket(f"127.0.0.{6 + i // 4}", port) for i in range(8)]
        for s in busy:  # each in the middle of a body: not idle
            s.sendall(
                b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 99\r\n\r\n{"
            )
        time.sleep(0.2)
        with peer_socket("127.0.0.1", port) as newcomer:
            status, body = answer_of(newcomer)
        assert status == 503 and "connections open (--connections)" in body["error"]
        for s in busy:
            s.close()


def test_the_gate_counts_each_connection_once_and_closes_the_largest_holders_idle_one():
    class Connection:
        def __init__(self, peer, idle_since):
            self.peer, self.idle_since, self.hung_up = peer, idle_since, False

        def hang_up(self):
            self.hung_up = True

    gate = Gate(total=3, per_peer=2)
    a1, a2, b1 = Connection("a", 1.0), Connection("a", 2.0), Connection("b", 0.0)
    assert [gate.admit(c) for c in (a1, a2, b1)] == [None, None, None]
    assert gate.admit(Connection("a", None))[0] == 429  # a holds its 2
    assert gate.admit(Connection("c", None)) is None and a1.hung_up and not b1.hung_up  # a's oldest idle
    gate.release(a1)  # lost after the hang-up: not counted twice
    gate.release(a1)
    assert gate.count == 3 and set(gate.by_peer) == {"a", "b", "c"}


@pytest.mark.slow  # a serve-rm process
def test_requests_are_served_while_peers_trickle_and_hoard(server):
    """Both floods at once, in threads, while other peers' requests go on."""
    url, port = server
    stop = threading.Event()

    def trickle():
        while not stop.is_set():
            with peer_socket("127.0.0.5", port) as s:
                try:
                    while not stop.is_set():
                        s.sendall(b"a")
                        time.sleep(0.3)
                except OSError:
                    pass

    threads = [threading.Thread(target=trickle, daemon=True) for _ in range(5)]
    for t in threads:
        t.start()
    hoard = [peer_socket("127.0.0.6", port) for _ in range(200)]
    try:
        assert all(score(url).status_code == 200 for _ in range(10))
    finally:
        stop.set()
        for s in hoard:
            s.close()


def test_a_malformed_head_is_a_400_in_json(saved_rm):
    from test_reward_server import running

    with running(saved_rm) as (url, _), peer_socket("127.0.0.1", int(url.rsplit(":", 1)[1])) as peer:
        peer.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n")
        status, body = answer_of(peer)
    assert status == 400 and "not an HTTP/1.1 request head" in body["error"]
