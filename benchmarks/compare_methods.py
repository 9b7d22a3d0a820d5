"""PPO against its cheaper relatives on the quickstart's toy world, judged by the hidden gold judge.

Per seed, one full quickstart (world, SFT, reward model, PPO, held-out evaluation); every row then reuses
that seed's SFT policy and reward model (``--models-from``) and runs its method, in its own process, for the
same number of sampled responses (1,280: PPO's 40 steps x 32 prompts):

- ``PPO``: the quickstart's defaults (a critic from the RM, GAE);
- critic-free estimators inside the PPO update (``ppo.advantage``): GRPO, Dr. GRPO and RLOO on groups of 4
  samples per prompt (8 prompts x 4 per step), REINFORCE++ on one sample per prompt;
- best-of-N rejection sampling (``lmppo best-of-n``): 5 rounds of 64 prompts x 4, or 32 prompts x 8.

``--rows`` with the ``lr`` variants tunes each method's learning rate on one seed first, so that no method
is judged by PPO's defaults. Prints a markdown table (mean ± sample std over the seeds); every run's
figures go to ``WORK/results.jsonl`` (resumable, as the other ablations).

    .venv/bin/python benchmarks/compare_methods.py --seeds 0 --rows "PPO,GRPO,GRPO lr 1e-3"

``--task tools`` compares them on the multi-turn tools world (``lmppo quickstart --task tools``: episodes
with a calculator, a programmatic reward). Its table adds the held-out episodes' turns, tool calls and
failed calls, and the reward.

"gap closed" is the share of the SFT -> perfect (2.7) held-out gold gap that the method closes; "ppl ×" the
held-out demonstration perplexity over SFT's (the alignment tax); "tokens" the response tokens sampled in
training; "train s" the seconds of the training steps alone (no evaluation); "peak RSS" the training
process's.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from ablate_quickstart import ROOT, run
from ablation import markdown_table, minimum, parser, run_rows, seeds_and_rows

GROUPS = ["rollout.batch_size=8", "rollout.samples_per_prompt=4"]  # 32 responses a step, as PPO's 32 prompts


def best_of(k: int) -> list[str]:
    """Best-of-k over 5 rounds of 256 responses (1,280 in all), one SFT epoch on each round's winners."""
    return ["run.algorithm=best_of_n", f"rollout.samples_per_prompt={k}", f"rollout.batch_size={256 // k}",
            "run.steps=5", "run.eval_every=1", "ppo.minibatch_size=16"]  # fmt: skip


VALUE_PRETRAINING = ["ppo.critic_warmup_steps=5", "ppo.lam_critic=1.0"]  # VC-PPO: 5 of the 40 steps
DECOUPLED_LAM = ["ppo.lam_critic=1.0", "ppo.lam_policy=0.95"]  # VC-PPO's pair; ppo.lam is 0.95 too
CLIP_HIGHER = ["ppo.clip_eps_high=0.28"]  # DAPO's 0.2 / 0.28

METHODS: dict[str, list[str]] = {
    "PPO": [],
    "PPO + value pretraining": VALUE_PRETRAINING,
    "PPO + decoupled λ": DECOUPLED_LAM,
    "PPO + both + clip-higher": [*VALUE_PRETRAINING, "ppo.lam_policy=0.95", *CLIP_HIGHER],
    "GRPO + dynamic sampling + clip-higher": [
        "ppo.advantage=grpo",
        *GROUPS,
        "rollout.dynamic_sampling=true",
        *CLIP_HIGHER,
    ],
    "GSPO": [
        "ppo.advantage=grpo",
        *GROUPS,
        "ppo.ratio_level=sequence",
        "ppo.clip_eps=3e-4",
        "ppo.clip_eps_high=4e-4",
        "ppo.loss_aggregation=sequence_mean",
        "guards.clip_frac_max=null",  # a clipped sequence clips all its tokens: GSPO's token share is high
    ],
    "Lite PPO": ["ppo.advantage=reinforce_pp_baseline", *GROUPS],
    "GRPO": ["ppo.advantage=grpo", *GROUPS],
    "Dr. GRPO": ["ppo.advantage=dr_grpo", *GROUPS],
    "RLOO": ["ppo.advantage=rloo", *GROUPS],
    "REINFORCE++": ["ppo.advantage=reinforce_pp"],
    "best-of-4": best_of(4),
    "best-of-8": best_of(8),
}
LEARNING_RATES = ("3e-5", "1e-4", "1e-3")  # around the quickstart's 3e-4
ROWS = {
    **METHODS,
    **{
        f"{name} lr {lr}": [*overrides, f"ppo.lr={lr}"]
        for name, overrides in METHODS.items()
        for lr in LEARNING_RATES
    },
}


def figures(out: Path, seed: int, overrides: list[str], models_from: Path | None, task: str) -> dict:
    """One quickstart run of a method (:func:`ablate_quickstart.run`) and what its run directory says of
    the training: response tokens sampled, the process's peak RSS."""
    result = run(out, seed, overrides, models_from, task)
    if "failed" in result:
        return result
    records = [json.loads(line) for line in (out / "ppo" / "metrics.jsonl").open()]
    config = yaml.safe_load((out / "ppo" / "config.yaml").read_text())
    responses = config["rollout"]["batch_size"] * config["rollout"]["samples_per_prompt"]
    trained = [r for r in records if "response/length" in r]
    return {
        **result,
        "tokens": sum(r["response/length"] * responses for r in trained),
        # dynamic sampling generates whole extra batches, of which the steps keep some
        "sampled": sum(responses * (1 + r.get("rollout/extra_rounds", 0)) for r in trained),
        "train_s": sum(r["perf/step_s"] for r in trained),  # the steps alone: no evaluation, no SFT/RM stages
        "peak_rss_mb": max(r["perf/peak_rss_mb"] for r in trained),
    }


TOOLS_COLUMNS = [
    ("gold", "gold_ppo", 3),
    ("gap closed", "gap_closed", 2),
    ("min gap closed", minimum("gap_closed", 2), 2),
    ("reward", "reward", 2),
    ("KL", "kl", 2),
    ("turns", "turns", 2),
    ("tool calls", "tool_calls", 2),
    ("failed calls", "tool_failures", 3),
    ("train s", "train_s", 0),
]
COLUMNS = [
    ("gold", "gold_ppo", 3),
    ("gap closed", "gap_closed", 2),
    ("min gap closed", minimum("gap_closed", 2), 2),
    ("win rate vs SFT", "win_rate", 2),
    ("KL", "kl", 1),
    ("ppl ×", "ppl_ratio", 2),
    ("tokens", "tokens", 0),
    ("responses sampled", "sampled", 0),
    ("train s", "train_s", 0),
    ("peak RSS MB", "peak_rss_mb", 0),
]


def main(argv=None) -> None:
    p = parser(__doc__, ROWS, ",".join(METHODS), ROOT / "runs" / "compare_methods")
    p.add_argument("--task", default="instruct", choices=("instruct", "tools"))
    args = p.parse_args(argv)
    seeds, rows = seeds_and_rows(args, ROWS)
    extra = args.extra.split()

    def run_one(row: str, seed: int) -> dict:
        base = args.work_dir / f"seed{seed}" / "base"
        if not (base / "ppo" / "quickstart.json").is_file():  # the seed's world, SFT policy and RM, once
            failed = run(base, seed, extra, None, args.task).get("failed")
            if failed is not None:
                raise SystemExit(f"the base quickstart of seed {seed} failed ({failed}); see {base}")
        out = args.work_dir / f"seed{seed}" / row.replace(" ", "_").replace(".", "")
        return figures(out, seed, [*extra, *ROWS[row]], base, args.task)

    results = run_rows(args.work_dir, seeds, rows, run_one, args.table_only)
    print(markdown_table(results, rows, ROWS, TOOLS_COLUMNS if args.task == "tools" else COLUMNS))


if __name__ == "__main__":
    main()
