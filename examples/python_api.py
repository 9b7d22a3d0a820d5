"""PPO from Python: the quickstart's SFT policy learns to count, rewarded by a function of our own.

`make quickstart` trains the SFT policy into runs/quickstart/sft; then

    .venv/bin/python examples/python_api.py

No config file and no prompt file: the config is a dict, the prompts are rows, the reward is a Python
function. Everything else is `lmppo ppo`'s run: checkpoints, guards, metrics.jsonl, final/.
"""

from __future__ import annotations

import argparse
import re

import lmppo


def counts_correctly(prompts: list, responses: list[str]) -> list[float]:
    """For 'count to n': the share of 1..n said in order, minus 0.5 for each number past n."""
    scores = []
    for prompt, response in zip(prompts, responses, strict=True):
        n = int(prompt.split()[-1])
        said = re.findall(r"\d+", response)
        in_order = sum(word == str(i + 1) for i, word in enumerate(said[:n]))
        scores.append(in_order / n - 0.5 * max(0, len(said) - n))
    return scores


def main(policy: str, output_dir: str, steps: int) -> lmppo.TrainResult:
    config = {
        "models": {"policy": {"path": policy}, "value": {"init_from": "policy"}},
        "rollout": {"batch_size": 8, "max_new_tokens": 16},
        "ppo": {"ppo_epochs": 2, "minibatch_size": 8, "lr": 3e-4, "value_lr": 1e-3},
        "kl": {"beta": 0.1},
        "run": {"steps": steps, "output_dir": output_dir},
        "logging": {"quiet": True},
    }
    prompts = [f"count to {n}" for n in range(3, 11)]

    def show(step: int, metrics: dict[str, float]) -> None:
        print(f"step {step:3d}  reward {metrics.get('reward/rm_score', float('nan')):+.3f}")

    result = lmppo.train(config, reward=counts_correctly, prompts=prompts, on_step=show)
    policy_model, tokenizer = result.policy(), result.tokenizer()
    print(
        f"trained policy: {type(policy_model).__name__} in {result.run_dir / 'final'}, vocabulary {len(tokenizer)}"
    )
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--policy", default="runs/quickstart/sft", help="an SFT checkpoint (default: the quickstart's)"
    )
    parser.add_argument("--output-dir", default="runs/python_api")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    main(args.policy, args.output_dir, args.steps)
