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
import subprocess
import sys
import time
from pathlib import Path

from ablation import markdown_table, minimum, parser, run_rows, seeds_and_rows

ROOT = Path(__file__).resolve().parents[1]
PERFECT_GOLD = 2.7
TOOLS_PERFECT_GOLD = 2.5  # lmppo.toy.tools.PERFECT_GOLD
BASE = "{base}"  # in a row's overrides: that seed's base quickstart, where prepare() writes what rows need
CLEAN_DEMOS = f"{BASE}/sft_train_clean.jsonl"  # the SFT demonstrations the gold judge rates correct and ended
ENSEMBLE = [
    f"{BASE}/rm",
    f"{BASE}/rm_1",
    f"{BASE}/rm_2",
]  # the default RM and two more (other head init, order)

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
    "rollout batch 64": ["rollout.batch_size=64", "ppo.minibatch_size=32"],
    "clean ptx 0.05": ["ppo.ptx_coef=0.05", f"data.ptx_demonstrations={CLEAN_DEMOS}"],
    "clean ptx 0.1": ["ppo.ptx_coef=0.1", f"data.ptx_demonstrations={CLEAN_DEMOS}"],
    "asynchronous": ["rollout.asynchronous=true"],  # one-step-off: each batch sampled one version behind
    "mean of 3 RMs": [
        "reward.model=null",
        "reward.batch_size=16",  # the default: with components, each sets its own
        "reward.components=["
        + ", ".join(
            f"{{name: rm{k}, model: {{path: {p}}}, weight: {1 / 3}, batch_size: 64}}"
            for k, p in enumerate(ENSEMBLE)
        )
        + "]",
    ],
}


def parse_args(argv=None) -> argparse.Namespace:
    return parser(__doc__, ROWS, ",".join(ROWS), ROOT / "runs" / "ablation").parse_args(argv)


def prepare(base: Path, seed: int, overrides: list[str]) -> list[str]:
    """What a row's overrides name in the seed's base quickstart, made once: the clean demonstrations, the
    extra reward models. Returns the overrides with ``{base}`` filled in."""
    from lmppo.inputs.data import read_jsonl
    from lmppo.toy.task import gold_score

    joined = " ".join(overrides)
    clean = Path(CLEAN_DEMOS.replace(BASE, str(base)))
    if CLEAN_DEMOS in joined and not clean.is_file():
        rows = [
            r
            for r in read_jsonl(base / "world" / "data" / "sft_train.jsonl")
            if gold_score(r["prompt"], r["response"]) >= 2.0
        ]
        clean.write_text("".join(json.dumps(row) + "\n" for row in rows))
    for k, path in enumerate(ENSEMBLE[1:], start=1):
        if path in joined and not Path(path.replace(BASE, str(base))).is_dir():
            train_another_reward_model(base, seed + 1000 * k, Path(path.replace(BASE, str(base))))
    return [override.replace(BASE, str(base)) for override in overrides]


def train_another_reward_model(base: Path, seed: int, out: Path) -> None:
    """The quickstart's RM stage again on the same SFT transformer and pairs, with another seed."""
    from lmppo.interface.quickstart import quickstart_config, train_toy_reward_model
    from lmppo.modeling.loading import load_causal_lm
    from lmppo.toy.models import load_toy_world

    world = load_toy_world(base / "world")
    stage = quickstart_config(base, base, world, []).reward_model
    train_toy_reward_model(load_causal_lm(base / "sft"), world, stage, seed, out)


def run(out: Path, seed: int, overrides: list[str], models_from: Path | None, task: str = "instruct") -> dict:
    """One quickstart of ``task`` in its own process; its figures."""
    command = [sys.executable, "-m", "lmppo", "quickstart", "--out", str(out), "--seed", str(seed)]
    command += ["--task", task, *overrides]
    if models_from is not None:
        command += ["--models-from", str(models_from)]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"failed": done.returncode, "stderr": done.stderr[-2000:]}
    result = json.loads((out / "ppo" / "quickstart.json").read_text())
    sft, ppo = result["summary"]["policies"]["SFT"], result["summary"]["policies"]["PPO"]
    perfect = PERFECT_GOLD if task == "instruct" else TOOLS_PERFECT_GOLD
    figures = {
        "gold_sft": sft["eval/gold_score"],
        "gold_ppo": ppo["eval/gold_score"],
        "gap_closed": (ppo["eval/gold_score"] - sft["eval/gold_score"]) / (perfect - sft["eval/gold_score"]),
        "win_rate": ppo["eval/win_rate"],
        "kl": ppo["eval/kl/ref"],
        "ppl_ratio": ppo["eval/demo_ppl"] / sft["eval/demo_ppl"],
        "wall_s": time.perf_counter() - started,
    }
    if task == "tools":  # episodes: how the policy uses the calculator
        for name in ("turns", "tool_calls", "tool_failures"):
            figures[f"{name}_sft"], figures[name] = sft[f"eval/episode/{name}"], ppo[f"eval/episode/{name}"]
        figures["reward_sft"], figures["reward"] = sft["eval/reward/rm_score"], ppo["eval/reward/rm_score"]
        return figures
    slices = json.loads((out / "ppo" / "eval.json").read_text())["policies"]["PPO"]["slices"]
    rm_slices = json.loads((out / "ppo" / "rm_eval.json").read_text())["slices"]["type"]
    return {
        **figures,
        "rm_accuracy": result["rm_accuracy"],
        "rm_accuracy_by_type": {kind: rm_slices[kind]["accuracy"] for kind in sorted(rm_slices)},
        "gold_repeat": slices["repeat"]["eval/gold_score"],
    }


COLUMNS = [
    ("gold PPO", "gold_ppo", 3),
    ("gap closed", "gap_closed", 2),
    ("min gap closed", minimum("gap_closed", 2), 2),
    ("win rate", "win_rate", 2),
    ("KL", "kl", 1),
    ("ppl ×", "ppl_ratio", 2),
    ("gold, repeat", "gold_repeat", 2),
]


def table(results: list[dict], rows: list[str]) -> str:
    return markdown_table(results, rows, ROWS, COLUMNS)


def main(argv=None) -> None:
    args = parse_args(argv)
    seeds, rows = seeds_and_rows(args, ROWS)
    extra = args.extra.split()

    def run_one(row: str, seed: int) -> dict:
        base = args.work_dir / f"seed{seed}" / "base"
        if row == "default":
            return run(base, seed, [*extra, *ROWS[row]], None)
        if not (base / "ppo" / "quickstart.json").is_file():
            raise SystemExit(f"{base} holds no finished quickstart: list the 'default' row first")
        overrides = prepare(base, seed, [*extra, *ROWS[row]])
        return run(args.work_dir / f"seed{seed}" / row.replace(" ", "_"), seed, overrides, base)

    print(table(run_rows(args.work_dir, seeds, rows, run_one, args.table_only), rows))


if __name__ == "__main__":
    main()
