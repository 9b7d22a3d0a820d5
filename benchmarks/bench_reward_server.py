"""`lmppo serve-rm` under load (issue 50): concurrent clients against one server on the toy reward model,
alone, beside idle connections held open, and beside a hostile flood (one peer holding hundreds of sockets
while another trickles request heads), with every answer checked against in-process scoring.

One `lmppo serve-rm` process on 127.0.0.1; ``--clients`` threads each POST requests of ``--rows`` rows for
``--seconds`` (the rows drawn from the toy world's held-out prompts, or from words when it is missing),
first alone, then with ``--idle`` connections held open beside them (each reopened when the server closes
it at its idle timeout), then while one peer (127.0.0.2) holds ``--flood`` sockets and another (127.0.0.3)
trickles ``--trickle`` request heads a byte every half second (each reopened when cut). For each phase: requests per second, p50 / p99 latency, errors (anything but a
200 with one number per row), the server's peak resident memory, and the answers against the same
request scored in-process (exactly equal, and the largest difference: a request scored in one model batch
with another's rows can differ in float32's last bits). The last line is the report as JSON.

    .venv/bin/python benchmarks/bench_reward_server.py                 # runs/quickstart/rm (make quickstart)
    .venv/bin/python benchmarks/bench_reward_server.py --seconds 10 --rm path/to/rm
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
WORDS = "good bad cat dog sun rain tree bird happy sad tell me about write short story poem day night".split()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rm", type=Path, default=ROOT / "runs" / "quickstart" / "rm")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--idle", type=int, default=20)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--flood", type=int, default=500)
    p.add_argument("--trickle", type=int, default=10)
    return p.parse_args(argv)


def request_rows(rm: Path, n: int, rows: int) -> list[dict]:
    """``n`` requests of ``rows`` (prompt, response) rows: held-out toy prompts when beside the RM."""
    prompts_file = rm.parent / "world" / "data" / "prompts_test.jsonl"
    rng = random.Random(0)
    prompts = (
        [json.loads(line)["prompt"] for line in prompts_file.open()]
        if prompts_file.is_file()
        else [" ".join(rng.choices(WORDS, k=6)) for _ in range(64)]
    )
    return [
        {
            "prompts": [rng.choice(prompts) for _ in range(rows)],
            "responses": [" ".join(rng.choices(WORDS, k=rng.randint(1, 12))) for _ in range(rows)],
        }
        for _ in range(n)
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(rm: Path, rows: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "lmppo", "serve-rm", str(rm), "--port", str(port), "--batch-size", str(rows)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return server, url
        except httpx.TransportError:
            time.sleep(0.2)
    server.kill()
    raise SystemExit("serve-rm did not come up within 120 s")


def rss_mb(pid: int, field: str) -> float:
    """Resident memory now (VmRSS) or at the peak (VmHWM)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith(field))) / 1024


def beside(holders: list[tuple], url: str, requests: list[dict], expected: list[list[float]], args) -> dict:
    """The load while processes of their own (peers, not threads taking the clients' GIL) run
    ``hold_idle`` with each of ``holders``' arguments."""
    spawn = multiprocessing.get_context("spawn")
    stop = spawn.Event()
    peers = [spawn.Process(target=hold_idle, args=(*h[:2], stop, *h[2:])) for h in holders]
    for peer in peers:
        peer.start()
    time.sleep(3)  # their sockets are open before the clients start
    try:
        return load(url, requests, expected, args)
    finally:
        stop.set()
        for peer in peers:
            peer.join()


def hold_idle(
    port: int, count: int, stop, address: str = "127.0.0.1", every_s: float = 0.2, drip: bool = False
) -> None:
    """``count`` connections from ``address`` that never send a byte (``drip``: a header byte each time),
    looked at every ``every_s`` and each reopened once the server has closed it (or refused it: a peer
    over its cap reconnects every ``every_s``)."""

    def connect() -> socket.socket:
        connection = socket.create_connection(("127.0.0.1", port), source_address=(address, 0))
        connection.setblocking(False)
        return connection

    held = [connect() for _ in range(count)]
    while not stop.wait(every_s):
        for i, connection in enumerate(held):
            try:
                closed = connection.recv(65536) == b""
                if drip and not closed:
                    connection.send(b"a")
            except BlockingIOError:
                closed = False
            except OSError:
                closed = True
            if closed:
                connection.close()
                held[i] = connect()
    for connection in held:
        connection.close()


def load(url: str, requests: list[dict], expected: list[list[float]], args) -> dict:
    """``args.clients`` threads posting ``requests`` round-robin for ``args.seconds``."""
    latencies, errors, exact, worst = [], [0], [0], [0.0]
    lock = threading.Lock()
    stop_at = time.monotonic() + args.seconds

    def client(k: int) -> None:
        with httpx.Client(timeout=60) as http:
            i = k
            while time.monotonic() < stop_at:
                started = time.perf_counter()
                try:
                    answer = http.post(f"{url}/score", json=requests[i % len(requests)])
                    rewards = answer.json()["rewards"] if answer.status_code == 200 else None
                except (httpx.HTTPError, ValueError, KeyError):
                    rewards = None
                took = time.perf_counter() - started
                want = expected[i % len(requests)]
                with lock:
                    if rewards is None or len(rewards) != len(want):
                        errors[0] += 1
                    else:
                        latencies.append(took)
                        exact[0] += rewards == want
                        worst[0] = max(worst[0], *(abs(a - b) for a, b in zip(rewards, want)))
                i += args.clients

    threads = [threading.Thread(target=client, args=(k,)) for k in range(args.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    latencies.sort()
    return {
        "requests_per_s": len(latencies) / args.seconds,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))],
        "errors": errors[0],
        "exact_answers": exact[0] / max(len(latencies), 1),
        "max_abs_diff": worst[0],
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    if not (args.rm / "config.json").is_file():
        raise SystemExit(f"no reward model at {args.rm}: run `make quickstart` first, or pass --rm DIR")
    from lmppo.rewards.reward_server import Rows, load_scorer

    scorer, _ = load_scorer(str(args.rm), args.rows, None)
    requests = request_rows(args.rm, 64, args.rows)
    expected = [  # each request scored alone, in-process
        scorer.score_ids(Rows(r["prompts"], r["responses"]).rendered(scorer, 0, args.rows)).tolist()
        for r in requests
    ]
    server, url = start_server(args.rm, args.rows)
    try:
        port = int(url.rsplit(":", 1)[1])
        start_rss = rss_mb(server.pid, "VmRSS")
        report = {"alone": load(url, requests, expected, args)}
        report[f"beside {args.idle} idle connections"] = beside(
            [(port, args.idle, "127.0.0.1")], url, requests, expected, args
        )
        flood = [(port, args.flood, "127.0.0.2", 1.0), (port, args.trickle, "127.0.0.3", 0.5, True)]
        flooded = f"beside {args.flood} sockets of a peer, {args.trickle} trickled heads"
        report[flooded] = beside(flood, url, requests, expected, args)
        report[flooded]["p99_over_alone"] = report[flooded]["p99_ms"] / report["alone"]["p99_ms"]
        rss = rss_mb(server.pid, "VmHWM")
    finally:
        server.terminate()
        server.wait(30)
    flags = sorted({f for f in ("amx_bf16", "avx512_bf16", "avx2") if f in Path("/proc/cpuinfo").read_text()})
    print(
        f"{datetime.date.today()}, CPU flags {' '.join(flags)}; {args.clients} clients x {args.rows} rows, "
        f"{args.seconds:g} s per phase; server RSS {start_rss:.0f} MB serving, {rss:.0f} MB at its peak"
    )
    print(
        f"{'phase':52s} {'req/s':>7s} {'p50 ms':>7s} {'p99 ms':>7s} {'errors':>6s} {'exact':>6s} {'max diff':>9s}"
    )
    for phase, r in report.items():
        print(
            f"{phase:52s} {r['requests_per_s']:7.1f} {r['p50_ms']:7.1f} {r['p99_ms']:7.1f} {r['errors']:6d} "
            f"{r['exact_answers']:6.0%} {r['max_abs_diff']:9.2g}"
        )
    print(
        json.dumps(
            {"phases": report, "server_rss_mb": start_rss, "server_peak_rss_mb": rss, "cpu_flags": flags}
        )
    )


if __name__ == "__main__":
    main()
