"""What the ablation scripts share: rows x seeds run once each (resumable), and a markdown table of
mean ± sample std over the seeds.

A row is a name and its overrides; ``run_one(row, seed) -> dict`` runs it and returns its figures, or
``{"failed": exit code, "stderr": ...}`` when the run stopped (a guard abort, say). Every result is appended
to ``WORK/results.jsonl`` as it comes, so an interrupted ablation resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

# (column label, result key, digits); a callable instead of a key computes the cell from the row's runs
Column = tuple[str, "str | Callable[[list[dict]], str]", int]


def parser(doc: str, rows: Sequence[str], default_rows: str, work_dir: Path) -> argparse.ArgumentParser:
    """The options every ablation takes: seeds, rows (by name), the work folder, extra overrides."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--rows", default=default_rows, help=f"comma-separated, of: {', '.join(rows)}")
    p.add_argument("--work-dir", type=Path, default=work_dir)
    p.add_argument("--extra", default="", help="overrides added to every row (space-separated)")
    p.add_argument(
        "--table-only",
        action="store_true",
        help="print the table of the runs already in results.jsonl; run none",
    )
    return p


def seeds_and_rows(args: argparse.Namespace, rows: Sequence[str]) -> tuple[list[int], list[str]]:
    """The parsed ``--seeds`` and ``--rows``; an unknown row name stops the script."""
    chosen = args.rows.split(",")
    if unknown := [row for row in chosen if row not in rows]:
        raise SystemExit(f"unknown rows {unknown}; pick from {list(rows)}")
    return [int(s) for s in args.seeds.split(",")], chosen


def minimum(key: str, digits: int) -> Callable[[list[dict]], str]:
    """A column cell: the lowest value of ``key`` over the row's seeds (the worst seed)."""
    return lambda runs: f"{min(r[key] for r in runs):.{digits}f}"


def mean_std(values: Sequence[float], digits: int) -> str:
    mean = statistics.fmean(values)
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.{digits}f} ± {spread:.{digits}f}"


def run_rows(
    work_dir: Path,
    seeds: Sequence[int],
    rows: Sequence[str],
    run_one: Callable[[str, int], dict],
    table_only: bool = False,
) -> list[dict]:
    """Every (row, seed) not yet in ``work_dir/results.jsonl`` (none with ``table_only``), seed by seed; all
    results of these seeds."""
    work_dir.mkdir(parents=True, exist_ok=True)
    results_file = work_dir / "results.jsonl"
    results = [json.loads(line) for line in results_file.open()] if results_file.is_file() else []
    done = {(r["row"], r["seed"]) for r in results}
    for seed in seeds:
        for row in rows:
            if (row, seed) in done or table_only:
                continue
            result = {"row": row, "seed": seed, **run_one(row, seed)}
            results.append(result)
            with results_file.open("a") as f:
                f.write(json.dumps(result) + "\n")
            print(json.dumps(result), file=sys.stderr, flush=True)
    return [r for r in results if r["seed"] in seeds]


def markdown_table(
    results: list[dict], rows: Sequence[str], overrides: dict[str, Sequence[str]], columns: Sequence[Column]
) -> str:
    """One line per row that has a finished run: its overrides, then mean ± std of each column; seeds whose
    run stopped are named beside the row."""
    lines = [
        "| row | overrides | " + " | ".join(name for name, _, _ in columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    for row in rows:
        runs = [r for r in results if r["row"] == row and "failed" not in r]
        stopped = sorted(r["seed"] for r in results if r["row"] == row and "failed" in r)
        if not runs:
            continue
        cells = [
            key(runs) if callable(key) else mean_std([r[key] for r in runs], digits)
            for _, key, digits in columns
        ]
        note = f" (seeds {stopped} stopped by a guard)" if stopped else ""
        lines.append(f"| {row}{note} | `{' '.join(overrides[row]) or '—'}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)
