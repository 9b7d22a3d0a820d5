"""Environments stepped together (``rollout.environment_workers``): the seconds a step waits on a slow tool.

``--episodes`` episodes (32) of ``--turns`` turns (3) on the toy world's policy (random weights, its EOS
boosted so that every turn ends at once and every episode plays all its turns), against a tool that takes
``--latency`` seconds (0.2) per step: in-process (``time.sleep``) and, with the MCP SDK installed, served by
an MCP server subprocess over stdio (``tests/mcp_server.py``'s ``sleep`` tool, called through
:func:`lmppo.sampling.mcp_tools.mcp_source`). Each row plays ``--steps`` batches, one after another
(``environment_workers=1``) and together (the default, 32), and reports the median of
``perf/environment_s`` (the wall time the batch waited on its environments) and of the generation's
seconds. The target: together, at most 1.5 x turns x latency (0.9 s). The figures are sleep-bound, so other
work on the machine barely moves them. Prints a table and, last, one JSON line, also appended to ``--out``
(the recorded runs: benchmarks/bench_environments.jsonl).

    .venv/bin/python benchmarks/bench_environments.py --out benchmarks/bench_environments.jsonl
    .venv/bin/python benchmarks/bench_environments.py --latency 0.02 --episodes 4 --steps 1   # a smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from lmppo.sampling.environments import Step
from lmppo.sampling.episodes import EpisodeGenerator
from lmppo.sampling.hf_engine import hf_generator
from lmppo.toy.models import build_policy
from lmppo.toy.task import prompts, tokenizer_corpus
from lmppo.toy.tokenizer import policy_tokenizer, train_bpe

ROOT = Path(__file__).resolve().parents[1]
MCP_SERVER = ROOT / "tests" / "mcp_server.py"  # its async sleep tool answers calls concurrently
WORKERS = {"serial": 1, "concurrent": 32}  # rollout.environment_workers: one at a time, the default


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--latency", type=float, default=0.2, help="seconds the tool takes per step")
    p.add_argument("--steps", type=int, default=2, help="batches per row (the median is reported)")
    p.add_argument("--no-mcp", action="store_true", help="skip the MCP server's row")
    p.add_argument(
        "--out", type=Path, help="append the JSON line here (the recorded runs: %(prog)s's .jsonl)"
    )
    return p.parse_args(argv)


class SleepingTool:
    """Each step waits ``latency`` seconds on the tool and answers with the user's next message."""

    latency = 0.2

    def reset(self, row, seed):
        pass

    def step(self, text):
        self.call()
        return Step(messages=[{"role": "user", "content": "go on"}], tool_calls=1)

    def call(self) -> None:
        time.sleep(self.latency)


class McpSleepingTool(SleepingTool):
    """The same tool served by an MCP server subprocess: one stdio connection, calls over it together."""

    source = None  # lmppo.sampling.mcp_tools.McpSource, set once the server is up

    def call(self) -> None:
        self.source.call("sleep", {"seconds": self.latency})


def toy_policy():
    """The toy world's tokenizer and untrained policy, ending every turn at once (EOS boosted)."""
    tokenizer = policy_tokenizer(train_bpe(tokenizer_corpus(0)))
    policy = build_policy(tokenizer, seed=0)
    head = policy.lm_head
    biased = type(head)(head.in_features, head.out_features, bias=True)
    biased.weight.data.copy_(head.weight.data)
    biased.bias.data.zero_()
    biased.bias.data[tokenizer.eos_token_id] = 30.0
    policy.lm_head = biased
    return policy, tokenizer


def run_row(environment: type, workers: int, policy, tokenizer, args) -> dict:
    """Median environment and generation seconds per batch of ``args.episodes`` episodes."""
    sampler = hf_generator(policy, tokenizer, max_new_tokens=4, seed=0)
    episodes = EpisodeGenerator(
        sampler.engine,
        sampler.renderer,
        environment,
        name=environment.__name__,
        max_turns=args.turns,
        max_total_tokens=96,
        seed=0,
        environment_workers=workers,
        environment_timeout_s=60.0,
    )
    rows = prompts(args.episodes, seed=0, split="train")
    environment_s, generation_s = [], []
    for _ in range(args.steps):
        rollout = episodes.generate([row["prompt"] for row in rows], 0)
        calls = int(rollout.episode.counts["tool_calls"].sum())
        if calls != args.episodes * args.turns:
            raise SystemExit(f"{calls} tool calls, not {args.episodes} x {args.turns}: a turn did not end")
        environment_s.append(rollout.episode.environment_s)
        generation_s.append(rollout.generation_s)
    episodes.close()
    return {
        "environment_s": statistics.median(environment_s),
        "generation_s": statistics.median(generation_s),
        "environment_s_each": environment_s,
    }


def cpu_flags() -> list[str]:
    """``lscpu | grep -o -E 'avx2|avx512f|avx512_bf16|amx[a-z_]*' | sort -u``."""
    info = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    return sorted(set(re.findall(r"avx2|avx512f|avx512_bf16|amx[a-z_]*", info)))


def tools(args) -> dict[str, type]:
    """The rows' tools: in-process, and the MCP server's when its SDK is here."""
    SleepingTool.latency = args.latency
    rows = {"in-process sleep": SleepingTool}
    if args.no_mcp:
        return rows
    try:
        from lmppo.sampling.mcp_tools import mcp_source
    except ImportError:
        return rows
    McpSleepingTool.source = mcp_source(f"mcp:{sys.executable} {MCP_SERVER}", timeout_s=60.0)
    return rows | {"MCP server (stdio)": McpSleepingTool}


def main(argv=None) -> None:
    args = parse_args(argv)
    policy, tokenizer = toy_policy()
    results = {}
    for tool, environment in tools(args).items():
        for mode, workers in WORKERS.items():
            results[f"{tool}, {mode}"] = run_row(environment, workers, policy, tokenizer, args)
            print(f"[environments] {tool}, {mode}: {json.dumps(results[f'{tool}, {mode}'])}", flush=True)
    if McpSleepingTool.source is not None:
        McpSleepingTool.source.close()
    target = 1.5 * args.turns * args.latency
    print(
        f"\n{args.episodes} episodes x {args.turns} turns, a tool of {args.latency:g} s; target {target:g} s"
    )
    print(f"{'row':40s} {'environment s/step':>18s} {'generation s/step':>18s}")
    for name, r in results.items():
        print(f"{name:40s} {r['environment_s']:18.2f} {r['generation_s']:18.2f}")
    report = {
        "date": datetime.date.today().isoformat(),
        "cpu_flags": cpu_flags(),
        "settings": {k: v for k, v in vars(args).items() if k != "out"} | {"target_s": target},
        "results": results,
    }
    if args.out is not None:
        with args.out.open("a") as out:
            out.write(json.dumps(report) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
