"""What serve-rm takes from a peer: one request's size and work, the time to send it, the connections
held open. Its own module, light to import, so serve-rm's flags read their defaults from here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server, and how long and how widely a peer may take to ask it
    (each has a serve-rm flag; docs/rewards.md lists them)."""

    max_body_bytes: int = 16 * 2**20
    max_values: int = 2**18  # JSON values (strings, numbers, lists, objects): what parsing a body creates
    max_rows: int = 4096
    max_messages: int = 256  # per conversation
    max_chars: int = 200_000  # per row: its prompt's messages and its response, or its query text
    max_request_chars: int = 4_000_000
    queue: int = 256  # requests waiting for the model; more get 503
    connections: int = 1024  # open at once, from every peer
    connections_per_client: int = 64  # open at once from one address
    max_bodies_bytes: int = 64 * 2**20  # of every request together, while received and parsed; more get 503
    timeout_s: float = 30.0  # to receive a request's body
    idle_s: float = 10.0  # to receive a whole request head, from connecting or from the last answer
