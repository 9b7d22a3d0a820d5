"""The quickstart's PPO settings, ablated: each row over several seeds, on the same SFT policy and RM per seed.

For every seed, one full quickstart (``base``: world, SFT, reward model, PPO, evaluation); then every row
runs PPO and the held-out evaluation again with its overrides on that seed's SFT policy and reward model
(``lmppo quickstart --models-from``), each in its own process. Prints a markdown table (mean ± sample std
over the seeds) and writes every run's figures to ``WORK/results.jsonl`` (a re-run skips rows already
there, so an interrupted ablation resumes).

    .venv/bin/python benchmarks/ablate_quickstart.py --seeds 0,1,2 --rows "default,ptx 0.1,beta 0.6"

"gap closed" is the share of the SFT -> perfect (2.7) held-out gold gap that PPO closes; "ppl ×" the
held-out demonstration perplexity of PPO over SFT's (the alignment tax).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PERFECT_GOLD = 2.7

E4 = ["ppo.ppo_epochs=4"]  # the defaults before issue 21; the first round of rows varied one setting on them
ROWS: dict[str, list[str]] = {
    "default": [],
    "4 epochs (before)": E4,
    "4 epochs + ptx 0.3": [*E4, "ppo.ptx_coef=0.3"],
    "4 epochs + ptx 1": [*E4, "ppo.ptx_coef=1.0"],
    "4 epochs + adaptive KL to 3": [*E4, "kl.adaptive=true", "kl.target=3", "kl.horizon=2000"],
    "4 epochs + beta 0.1": [*E4, "kl.beta=0.1"],
    "4 epochs + beta 0.6": [*E4, "kl.beta=0.6"],
    "4 epochs + reward normalised": [*E4, "reward.normalize=true"],
    "4 epochs + critic warmup 5": [*E4, "ppo.critic_warmup_steps=5"],
    "4 epochs + lr 1e-4": [*E4, "ppo.lr=1e-4"],
    "4 epochs + lr 6e-4": [*E4, "ppo.lr=6e-4"],
    "4 epochs + 80 steps": [*E4, "run.steps=80", "run.eval_every=20"],
    "ptx 0.05": ["ppo.ptx_coef=0.05"],
    "ptx 0.1": ["ppo.ptx_coef=0.1"],
    "ptx 0.3": ["ppo.ptx_coef=0.3"],
    "ptx 0.1 + 60 steps": ["ppo.ptx_coef=0.1", "run.steps=60", "run.eval_every=20"],
    "beta 0.6": ["kl.beta=0.6"],
    "beta 0.45": ["kl.beta=0.45"],
    "1 epoch": ["ppo.ppo_epochs=1"],
    "lr 2e-4": ["ppo.lr=2e-4"],
    "entropy 0.01": ["ppo.ent_coef=0.01"],
    "entropy 0.03": ["ppo.ent_coef=0.03"],
    "one minibatch of 32": ["ppo.minibatch_size=32"],
    "60 steps": ["run.steps=60", "run.eval_every=20"],
    "lr 2e-4 + 60 steps": ["ppo.lr=2e-4", "run.steps=60", "run.eval_every=20"],
    "lr 2e-4 + 80 steps": ["ppo.lr=2e-4", "run.steps=80", "run.eval_every=20"],
    "one minibatch of 32 + 60 steps": ["ppo.minibatch_size=32", "run.steps=60", "run.eval_every=20"],
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of: {', '.join(ROWS)}")
    p.add_argument("--work-dir", type=Path, default=ROOT / "runs" / "ablation")
    p.add_argument("--extra", default="", help="overrides added to every row (space-separated)")
    return p.parse_args(argv)


def run(out: Path, seed: int, overrides: list[str], models_from: Path | None) -> dict:
    """One quickstart in its own process; its figures."""
    command = [
        sys.executable,
        "-m",
        "lmppo",
        "quickstart",
        "--out",
        str(out),
        "--seed",
        str(seed),
        *overrides,
    ]
    if models_from is not None:
        command += ["--models-from", str(models_from)]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"failed": done.returncode, "stderr": done.stderr[-2000:]}
    result = json.loads((out / "ppo" / "quickstart.json").read_text())
    sft, ppo = result["summary"]["policies"]["SFT"], result["summary"]["policies"]["PPO"]
    slices = json.loads((out / "ppo" / "eval.json").read_text())["policies"]["PPO"]["slices"]
    rm_slices = json.loads((out / "ppo" / "rm_eval.json").read_text())["slices"]["type"]
    return {
        "rm_accuracy": result["rm_accuracy"],
        "rm_accuracy_by_type": {kind: rm_slices[kind]["accuracy"] for kind in sorted(rm_slices)},
        "gold_sft": sft["eval/gold_score"],
        "gold_ppo": ppo["eval/gold_score"],
        "gap_closed": (ppo["eval/gold_score"] - sft["eval/gold_score"])
        / (PERFECT_GOLD - sft["eval/gold_score"]),
        "win_rate": ppo["eval/win_rate"],
        "kl": ppo["eval/kl/ref"],
        "ppl_ratio": ppo["eval/demo_ppl"] / sft["eval/demo_ppl"],
        "gold_repeat": slices["repeat"]["eval/gold_score"],
        "wall_s": time.perf_counter() - started,
    }


def mean_std(values: list[float], digits: int) -> str:
    mean = statistics.fmean(values)
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.{digits}f} ± {spread:.{digits}f}"


def table(results: list[dict], rows: list[str]) -> str:
    columns = [
        ("gold PPO", "gold_ppo", 3),
        ("gap closed", "gap_closed", 2),
        ("min gap closed", None, 2),
        ("win rate", "win_rate", 2),
        ("KL", "kl", 1),
        ("ppl ×", "ppl_ratio", 2),
        ("gold, repeat", "gold_repeat", 2),
    ]
    lines = [
        "| row | overrides | " + " | ".join(name for name, _, _ in columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    for row in rows:
        runs = [r for r in results if r["row"] == row and "failed" not in r]
        aborted = sorted(r["seed"] for r in results if r["row"] == row and "failed" in r)
        if not runs:
            continue
        cells = []
        for _, key, digits in columns:
            if key is None:
                cells.append(f"{min(r['gap_closed'] for r in runs):.2f}")
            else:
                cells.append(mean_std([r[key] for r in runs], digits))
        overrides = " ".join(ROWS[row]) or "—"
        note = f" (seeds {aborted} stopped by a guard)" if aborted else ""
        lines.append(f"| {row}{note} | `{overrides}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = args.rows.split(",")
    if unknown := [row for row in rows if row not in ROWS]:
        raise SystemExit(f"unknown rows {unknown}; pick from {list(ROWS)}")
    extra = args.extra.split()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    results_file = args.work_dir / "results.jsonl"
    results = [json.loads(line) for line in results_file.open()] if results_file.is_file() else []
    done = {(r["row"], r["seed"]) for r in results}
    for seed in seeds:
        base = args.work_dir / f"seed{seed}" / "base"
        for row in rows:
            if (row, seed) in done:
                continue
            out = base if row == "default" else args.work_dir / f"seed{seed}" / row.replace(" ", "_")
            if row != "default" and not (base / "ppo" / "quickstart.json").is_file():
                raise SystemExit(f"{base} holds no finished quickstart: list the 'default' row first")
            result = {
                "row": row,
                "seed": seed,
                **run(out, seed, [*extra, *ROWS[row]], None if row == "default" else base),
            }
            results.append(result)
            with results_file.open("a") as f:
                f.write(json.dumps(result) + "\n")
            print(json.dumps(result), file=sys.stderr, flush=True)
    print(table([r for r in results if r["seed"] in seeds], rows))


if __name__ == "__main__":
    main()
