"""The SmolLM2 example's PPO runs, each row over several seeds: the programmatic reward and the learned RMs.

Each (row, seed) runs ``lmppo ppo CONFIG`` with the row's overrides and ``run.seed``, then ``lmppo eval`` on
the 208 held-out prompts (start vs PPO, judged by ``judge.py``), each in its own process. Prints a markdown
table (mean ± sample std over the seeds) and writes every run's figures to ``WORK/results.jsonl`` (a re-run
skips rows already there). Run from the repository root after ``python examples/smollm2/prepare.py`` (and,
for the RM rows, the reward models they name):

    .venv/bin/python benchmarks/ablate_smollm2.py --seeds 0,1,2 --rows "judge,rm balanced"

"meets" is the share of held-out answers meeting the target (correct, at most 12 words, not repetitive);
"best meets" the best of the run's own held-out evaluations (every ``run.eval_every`` steps; ``best/``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ablation import markdown_table, minimum, parser, run_rows, seeds_and_rows

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "smollm2"

JUDGE, RM = "ppo_judge.yaml", "ppo_rm.yaml"
GROUPS = ["rollout.batch_size=4", "rollout.samples_per_prompt=4"]  # 16 responses a step, as the example's 16
BEST_OF_N_ROWS = {"judge best-of-4"}  # run with `lmppo best-of-n`, the others with `lmppo ppo`
# row -> (config in examples/smollm2/, overrides)
ROWS: dict[str, tuple[str, list[str]]] = {
    "judge": (JUDGE, []),
    "judge 30 steps": (JUDGE, ["run.steps=30", "kl.beta=0.05"]),  # the example before issue 21
    "judge beta 0.05": (JUDGE, ["run.steps=60", "kl.beta=0.05"]),  # the example's KL coefficient before 0.02
    "judge 60 steps": (JUDGE, ["run.steps=60"]),  # the example's length before 120 steps
    "judge lr 2e-4": (JUDGE, ["ppo.lr=2e-4"]),
    # issue 38: no critic, 60 steps of 16 responses as "judge 60 steps" (4 prompts x 4 samples)
    "judge rloo 60 steps": (JUDGE, ["run.steps=60", "ppo.advantage=rloo", *GROUPS]),
    "judge grpo 60 steps": (JUDGE, ["run.steps=60", "ppo.advantage=grpo", *GROUPS]),
    "judge reinforce_pp 60 steps": (JUDGE, ["run.steps=60", "ppo.advantage=reinforce_pp"]),
    # best-of-4: 4 rounds of 64 prompts x 4 (1,024 responses against PPO's 960), one SFT epoch each
    "judge best-of-4": (
        JUDGE,
        ["run.steps=4", "run.eval_every=1", "rollout.samples_per_prompt=4", "rollout.batch_size=64"],
    ),
    "rm": (RM, []),  # the RM of rm.yaml: natural + correctness-contrast pairs (prepare.py --pairs)
    # rm.yaml on the natural pairs alone (prepare.py --pairs --samples-per-prompt 2), and on their length-balanced part
    "rm natural": (RM, ["reward.model.path=runs/smollm2/rm_natural"]),
    "rm balanced": (RM, ["reward.model.path=runs/smollm2/rm_balanced"]),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__doc__, ROWS, "judge,rm", ROOT / "runs" / "ablation_smollm2")
    p.add_argument(
        "--rm-report",
        default="",
        metavar="DIRS",
        help="instead: the held-out pair accuracy of these reward models (comma-separated), by what decided "
        "each pair and by which answer is shorter",
    )
    p.add_argument("--pairs", type=Path, default=ROOT / "runs" / "smollm2" / "prefs_test.jsonl")
    return p.parse_args(argv)


def lmppo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmppo", *args], capture_output=True, text=True, check=False)


def judge_row(prompt, response: str) -> dict:
    """judge.py's verdict on one answer (load_function imports the file once and reuses the module)."""
    from lmppo.rewards.scoring import load_function

    return load_function(f"{EXAMPLE / 'judge.py'}:judge_row", "the SmolLM2 judge")(prompt, response)


def decided_by(pair: dict) -> str:
    """What the judge ranked the pair by: correctness first, then repetition, then brevity."""
    chosen, rejected = judge_row(pair["prompt"], pair["chosen"]), judge_row(pair["prompt"], pair["rejected"])
    for key in ("correct", "repetitive"):
        if chosen[key] != rejected[key]:
            return "correctness" if key == "correct" else "repetition"
    return "brevity"


def rm_report(directories: list[str], pairs_path: Path) -> dict:
    """Held-out accuracy of each reward model, overall and by slice: ``decided_by`` and ``chosen_is``
    (is the chosen answer the shorter or the longer one, in words)."""
    from lmppo.modeling.loading import load_reward_model, load_tokenizer
    from lmppo.training.reward_modeling import evaluate_reward_model, load_preference_jsonl

    pairs = load_preference_jsonl(pairs_path)
    for pair in pairs:
        gap = len(pair["chosen"].split()) - len(pair["rejected"].split())
        pair["decided_by"] = decided_by(pair)
        pair["chosen_is"] = "shorter" if gap < 0 else "longer" if gap > 0 else "as long"
    report = {}
    for directory in directories:
        result = evaluate_reward_model(
            load_reward_model(directory),
            load_tokenizer(directory),
            pairs,
            slice_keys=("decided_by", "chosen_is"),
        )
        report[directory] = {"accuracy": result["accuracy"]} | {
            f"{key}={value}": (summary["n"], round(summary["accuracy"], 3))
            for key, slices in result["slices"].items()
            for value, summary in slices.items()
        }
    return report


def run(out: Path, seed: int, config: str, overrides: list[str], command: str = "ppo") -> dict:
    """One run (``lmppo ppo``, or ``command``) and its held-out evaluation; their figures."""
    started = time.perf_counter()
    done = lmppo(
        command,
        str(EXAMPLE / config),
        f"run.seed={seed}",
        f"run.output_dir={out}",
        "logging.quiet=true",
        *overrides,
    )
    wall_s = time.perf_counter() - started
    if done.returncode == 0:
        done = lmppo("eval", str(out))
    if done.returncode != 0:
        return {"failed": done.returncode, "stderr": done.stderr[-2000:]}
    return {**figures(out), "wall_s": wall_s}


def figures(out: Path) -> dict:
    """The held-out figures of a finished run: ``eval.json`` (start vs PPO, per answer) and the run's own
    evaluations in ``metrics.jsonl``."""
    from lmppo.inputs.config import load_config
    from lmppo.training.metrics import read_metrics

    record = json.loads((out / "eval.json").read_text())
    ppo = record["summary"]["policies"]["PPO"]
    judged = [judge_row(row["prompt"], row["response"]) for row in record["policies"]["PPO"]["rows"]]
    evals = [(r["step"], r["eval/gold_score"]) for r in read_metrics(out) if "eval/gold_score" in r]
    best_step, best = max(evals, key=lambda e: e[1])
    result = {
        "meets_start": record["summary"]["policies"]["start"]["eval/gold_score"],
        "meets": ppo["eval/gold_score"],
        "correct": statistics.fmean(j["correct"] for j in judged),
        "brief": statistics.fmean(j["brief"] for j in judged),
        "length": ppo["eval/response/length"],
        "eos": ppo["eval/response/eos_frac"],
        "kl": ppo["eval/kl/ref"],
        "win_rate": ppo["eval/win_rate"],
        "best_meets": best,
        "best_step": best_step,
        "evals": evals,
    }
    reward_model = load_config(out / "config.yaml").reward.model
    rm_eval = Path(reward_model.path) / "rm_eval.json" if reward_model else None
    if rm_eval is not None and rm_eval.is_file():
        result["rm_accuracy"] = json.loads(rm_eval.read_text())["accuracy"]
    return result


COLUMNS = [
    ("meets", "meets", 3),
    ("min meets", minimum("meets", 3), 3),
    ("correct", "correct", 2),
    ("brief", "brief", 2),
    ("length", "length", 1),
    ("EOS", "eos", 2),
    ("KL", "kl", 1),
    ("win rate", "win_rate", 2),
    ("best meets", "best_meets", 3),
    ("RM accuracy", lambda runs: f"{runs[0]['rm_accuracy']:.3f}" if "rm_accuracy" in runs[0] else "—", 3),
    ("min/run", lambda runs: f"{statistics.fmean(r['wall_s'] for r in runs) / 60:.1f}", 1),
]


def table(results: list[dict], rows: list[str]) -> str:
    return markdown_table(results, rows, {row: ROWS[row][1] for row in ROWS}, COLUMNS)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.rm_report:
        print(json.dumps(rm_report(args.rm_report.split(","), args.pairs), indent=1))
        return
    seeds, rows = seeds_and_rows(args, ROWS)
    extra = args.extra.split()

    def run_one(row: str, seed: int) -> dict:
        config, overrides = ROWS[row]
        command = "best-of-n" if row in BEST_OF_N_ROWS else "ppo"
        out = args.work_dir / f"seed{seed}" / row.replace(" ", "_")
        return run(out, seed, config, [*extra, *overrides], command)

    print(table(run_rows(args.work_dir, seeds, rows, run_one, args.table_only), rows))


if __name__ == "__main__":
    main()
