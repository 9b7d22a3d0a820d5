"""Prepare the SmolLM2 calculator example: the model cache and the data files; or evaluate a model.

Run from the repository root:
    python examples/smollm2_calculator/prepare.py                    # data files + SmolLM2 conversion
    python examples/smollm2_calculator/prepare.py --evaluate DIR     # play the held-out problems with DIR

The data files (committed) are calculator.datasets(): data/sft_{train,test}.jsonl ({"messages"} episodes
for `lmppo sft`) and data/prompts_{train,test}.jsonl ({"prompt", "kind"} for PPO and its evaluation).
--evaluate plays every held-out problem with a model directory (.cache/lmppo/smollm2 for the base model,
runs/smollm2_calculator/sft, a run's final/) as ppo.yaml's evaluation does, and prints the judge's
share correct, tool calls and failed calls per episode, and the means per kind.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from lmppo.user_code import load_function  # examples/ is no package: files load by path, as lmppo loads them

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def write_data() -> None:
    for name, rows in load_function(f"{HERE / 'calculator.py'}:datasets")().items():
        path = HERE / "data" / f"{name}.jsonl"
        path.parent.mkdir(exist_ok=True)
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        print(f"wrote {path.relative_to(REPO)} ({len(rows)} rows)")


def evaluate(model_dir: str, overrides: list[str]) -> None:
    from lmppo.inputs.config import load_config
    from lmppo.inputs.data import load_prompt_rows, load_prompts
    from lmppo.inputs.resolve import resolve
    from lmppo.modeling.loading import load_causal_lm, load_tokenizer
    from lmppo.rewards.scoring import load_reward_function
    from lmppo.runs.build import generator_options, policy_generator
    from lmppo.runs.evaluate import evaluate_policy
    from lmppo.user_code import load_function

    cfg = load_config(HERE / "ppo.yaml", [f"models.policy.path={model_dir}", *overrides])
    spec, path = resolve(cfg), cfg.data.eval_prompts
    policy, tokenizer = load_causal_lm(cfg.models.policy), load_tokenizer(cfg.models.policy)
    options = generator_options(cfg)
    start = time.perf_counter()
    result = evaluate_policy(
        policy,
        tokenizer,
        load_prompts(path),
        reward_fn=load_reward_function(cfg.reward.function),
        gold_fn=load_function(cfg.data.eval_judge),
        generator_options=options,
        slices=[row["kind"] for row in load_prompt_rows(path)],
        batch_size=cfg.run.eval_batch_size,
        seed=cfg.run.seed,
        generator=policy_generator(cfg, spec, policy, tokenizer),
        rows=load_prompt_rows(path),
    )
    print(f"{model_dir}: {len(result.rows)} held-out problems in {time.perf_counter() - start:.0f} s")
    for name in (
        "eval/gold_score",
        "eval/episode/tool_calls",
        "eval/episode/tool_failures",
        "eval/episode/turns",
    ):
        print(f"  {name:28s} {result.metrics[name]:.3f}")
    for kind, means in sorted(result.slices.items()):
        print(
            f"  {kind:8s} correct {means['eval/gold_score']:.2f}  calls {means['eval/episode/tool_calls']:.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--evaluate", metavar="DIR", help="play the held-out problems with this model")
    parser.add_argument("overrides", nargs="*", help="ppo.yaml overrides for --evaluate, e.g. run.seed=1")
    args = parser.parse_args()
    if args.evaluate:
        return evaluate(args.evaluate, args.overrides)
    write_data()
    load_function(f"{REPO / 'examples' / 'smollm2' / 'prepare.py'}:load_model")()  # converts SmolLM2 once


if __name__ == "__main__":
    main()
