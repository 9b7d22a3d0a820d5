"""serve-rm's connections, guarded beneath the app: uvicorn's h11 protocol with a deadline for each request
head and caps on open connections, per peer address and in all, so that no peer can hold the server.

uvicorn has neither (its keep-alive timer stops at a peer's first byte, so a head trickled a byte at a time
is waited for forever, and its one connection cap answers every peer's requests with a plain-text 503 once
any peer fills it). Hypercorn and granian have no per-peer cap either; uvicorn is the best kept of the
three, so this small subclass of its protocol adds what is missing:
- a whole request head within ``idle_s`` of connecting or of the last answer, however it arrives;
- at most ``connections_per_client`` open from one address (more are answered a JSON 429 and closed), at
  most ``connections`` in all: past it the idle connection of the address that holds the most is closed
  to make room, and with none idle the newcomer gets a JSON 503;
- uvicorn's answer to a malformed head (400) as JSON, like every other refusal.
The body's own deadline is the app's (:func:`lmppo.rewards.reward_server.read_body`): a 408 in JSON.
"""

from __future__ import annotations

import json
from collections import defaultdict

REFUSAL_GRACE_S = 1.0  # a refused peer has this long to read its answer before the socket closes


class Gate:
    """The open connections by peer address, admitted under the two caps."""

    def __init__(self, total: int, per_peer: int) -> None:
        self.total, self.per_peer = total, per_peer
        self.by_peer: dict[str, set] = defaultdict(set)
        self.count = 0

    def admit(self, connection) -> tuple[int, str] | None:
        """None when ``connection`` may stay; else the status and message it is refused with."""
        if len(self.by_peer[connection.peer]) >= self.per_peer:
            self._forget_empty(connection.peer)
            return 429, (
                f"this address already has {self.per_peer} connections open to the server, the most it keeps "
                "per address (--connections-per-client); reuse them (keep-alive) or close some"
            )
        if self.count >= self.total and not self._close_an_idle_one():
            return 503, f"the server has its {self.total} connections open (--connections); retry later"
        self.by_peer[connection.peer].add(connection)
        self.count += 1
        return None

    def release(self, connection) -> None:
        """``connection`` is gone (idempotent: a closed connection is released again when it is lost)."""
        held = self.by_peer.get(connection.peer)
        if held is not None and connection in held:
            held.discard(connection)
            self.count -= 1
            self._forget_empty(connection.peer)

    def _close_an_idle_one(self) -> bool:
        """Make room: close the longest-idle connection of the address holding the most."""
        idle = [c for held in self.by_peer.values() for c in held if c.idle_since is not None]
        if not idle:
            return False
        victim = max(idle, key=lambda c: (len(self.by_peer[c.peer]), -c.idle_since))
        victim.hang_up()
        self.release(victim)
        return True

    def _forget_empty(self, peer: str) -> None:
        if not self.by_peer.get(peer):
            self.by_peer.pop(peer, None)


def json_answer(status: int, message: str, reason: str) -> bytes:
    """A whole HTTP/1.1 answer with ``{"error": message}`` that closes the connection."""
    body = json.dumps({"error": message}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def guarded_protocol(gate: Gate, idle_s: float):
    """uvicorn's h11 protocol class with the head deadline and ``gate``'s caps."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.peer = (self.client or ("-",))[0]
            self.head_deadline, self.idle_since, self.refused = None, None, False
            refusal = gate.admit(self)
            if refusal is None:
                self._await_head()
            else:
                self._refuse(*refusal)

        def connection_lost(self, exc) -> None:
            gate.release(self)
            self._stop_waiting()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if not self.refused:  # a refused peer's request is read and dropped
                super().data_received(data)

        def eof_received(self) -> bool | None:
            if self.refused:
                self.hang_up()
            return super().eof_received()

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a whole request head arrived: the app has it now
                self._stop_waiting()

        def on_response_complete(self) -> None:
            if not self.transport.is_closing():
                self._await_head()  # the next head's deadline runs from this answer (a kept-alive connection)
            super().on_response_complete()

        def send_400_response(self, msg: str) -> None:  # a malformed head, as JSON
            self.transport.write(json_answer(400, f"not an HTTP/1.1 request head: {msg}", "Bad Request"))
            self.hang_up()

        def hang_up(self) -> None:
            self._stop_waiting()
            if not self.transport.is_closing():
                self.transport.close()

        def _await_head(self) -> None:
            self._stop_waiting()
            self.idle_since = self.loop.time()
            self.head_deadline = self.loop.call_later(idle_s, self.hang_up)

        def _stop_waiting(self) -> None:
            if self.head_deadline is not None:
                self.head_deadline.cancel()
            self.head_deadline, self.idle_since = None, None

        def _refuse(self, status: int, message: str) -> None:
            """Answer at once and half-close; the socket closes when the peer does, or after a grace."""
            self.refused = True
            self.transport.write(
                json_answer(status, message, "Too Many Requests" if status == 429 else "Service Unavailable")
            )
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(REFUSAL_GRACE_S, self.hang_up)

    return GuardedH11Protocol
