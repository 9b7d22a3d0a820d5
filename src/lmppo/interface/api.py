"""The Python API: a PPO run from a notebook or a script, on the same code path as ``lmppo ppo``.

    import lmppo

    result = lmppo.train(
        "my_config.yaml",                      # or a dict, or a lmppo.inputs.config.Config
        reward=lambda prompts, responses: [float(len(r) < 40) for r in responses],
        prompts=["Say hi.", {"messages": [{"role": "user", "content": "Name a colour."}]}],
        on_step=lambda step, metrics: print(step, metrics["reward/rm_score"]),  # after each PPO step
    )
    policy, tokenizer = result.policy(), result.tokenizer()

Everything the CLI does happens here too (the plan's refusal, guards, checkpoints, evaluation, the
report's files); ``resume=True`` continues the run in ``run.output_dir``, with the reward function passed
again. The function's name is what the run's ``config.yaml`` records (``reward.function: python:NAME``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmppo.inputs.config import Config, apply_override, read_yaml, validate_config
from lmppo.inputs.data import Prompt

RewardFunction = Callable[[list[Prompt], list[str]], Sequence[float]]
StepCallback = Callable[[int, dict[str, float]], None]


@dataclass
class TrainResult:
    """A finished run: its directory (checkpoints, ``metrics.jsonl``, ``final/``) and its config."""

    run_dir: Path
    config: Config

    @property
    def metrics(self) -> list[dict[str, float]]:
        """Every step's record, step 0 (the starting policy) first."""
        from lmppo.training.metrics import read_metrics

        return read_metrics(self.run_dir)

    def policy(self):
        """The trained policy as a transformers model (LoRA merged), loaded from ``final/``."""
        from lmppo.modeling.loading import load_causal_lm

        return load_causal_lm(str(self.run_dir / "final"))

    def tokenizer(self):
        from lmppo.modeling.loading import load_tokenizer

        return load_tokenizer(str(self.run_dir / "final"))


def train(
    config: Config | dict[str, Any] | str | Path,
    *,
    overrides: Sequence[str] = (),
    reward: RewardFunction | None = None,
    environment: type | None = None,
    prompts: Sequence[Prompt | dict[str, Any]] | None = None,
    eval_prompts: Sequence[Prompt | dict[str, Any]] | None = None,
    on_step: StepCallback | None = None,
    resume: bool = False,
    force: bool = False,
    verbose: bool = False,
) -> TrainResult:
    """Run PPO (or best-of-N, by ``run.algorithm``) as configured; returns the finished run.

    ``config``: a YAML path, a dict of sections or a :class:`~lmppo.inputs.config.Config`; ``overrides`` as on
    the command line (``"ppo.lr=3e-6"``). ``reward``: a function ``(prompts, responses) -> one float per
    row`` used as ``reward.function`` (it replaces the config's reward). ``environment``: an environment
    class (``reset(row, seed)`` and ``step(text)``, docs/multiturn.md) used as ``rollout.environment``; the
    config's ``rollout.environment`` may be the class itself too. ``prompts`` and ``eval_prompts``:
    the rows themselves (strings, message lists, or dicts with a ``prompt``/``messages`` column or the
    one ``data.prompt_key`` names) instead of files. ``on_step(step, metrics)`` is called on the main
    process after each PPO step (1, 2, ...) with its global metrics; the starting policy's record (step 0:
    its evaluation and the reward pre-flight) is ``result.metrics[0]``. ``verbose`` leaves transformers'
    progress bars and load reports on. Bad input raises :class:`lmppo.errors.LmppoError` with the message
    the CLI prints.
    """
    from lmppo.modeling.loading import quiet_transformers
    from lmppo.runs.run import train as run_training
    from lmppo.user_code import python_function_spec

    raw = _raw_config(config)
    for override in overrides:
        apply_override(raw, override)
    if reward is not None:  # the function replaces whatever reward the config names
        kept = {k: v for k, v in raw.get("reward", {}).items() if k not in ("model", "components", "gate")}
        raw["reward"] = {**kept, "function": python_function_spec(reward)}
    rollout = raw.setdefault("rollout", {})
    environment = environment or rollout.get("environment")
    if isinstance(environment, type):  # recorded as python:NAME, as a reward function is
        rollout["environment"] = python_function_spec(environment)
    data = raw.setdefault("data", {})
    if prompts is not None:
        data["prompts"] = list(prompts)
    if eval_prompts is not None:
        data["eval_prompts"] = list(eval_prompts)
    cfg = validate_config(
        raw, source="the config given to lmppo.train", overrides=overrides, overrides_from="lmppo.train"
    )
    if not verbose:
        quiet_transformers()
    run_dir = run_training(cfg, resume=resume, force=force, on_step=on_step)
    return TrainResult(Path(run_dir), cfg)


def _raw_config(config: Config | dict[str, Any] | str | Path) -> dict[str, Any]:
    """The config as plain sections (a copy), whatever form it came in; validated once, at the end."""
    if isinstance(config, Config):
        return config.model_dump(mode="json")
    if isinstance(config, dict):
        return copy.deepcopy(config)
    return read_yaml(config)
