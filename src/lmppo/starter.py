"""``lmppo init``: a commented starter config for a user's own policy, reward and prompts, sized by the
memory plan for this machine.

The starter takes the project's defaults for everything the user did not name, then asks the plan
(:mod:`lmppo.plan`) whether it fits the device; while it does not, it takes the plan's own first remedy
(the seeds' ladder: LoRA, quantized frozen models, ... then bf16, gradient checkpointing, token budgets)
and asks again. On a CPU a policy above 100M parameters gets LoRA first, for speed. Each line of the written YAML carries the schema's description of its key.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import yaml
from pydantic import BaseModel

from lmppo.config import Config, apply_override, validate_config
from lmppo.config_reference import section_of
from lmppo.errors import LmppoError

# On a CPU, full fine-tuning above this many policy parameters takes minutes per step (SmolLM2-135M on
# 2 cores: about 2 min); LoRA trains ~4 % of them and the reference shares the base weights.
CPU_FULL_TUNING_MAX = 100_000_000
MAX_REMEDIES = 8  # the ladder has fewer rungs than this; a plan still too large after them is reported


@dataclass
class StarterAnswers:
    """What the user names; everything else is a default."""

    policy: str
    prompts: str
    reward_model: str | None = None
    reward_function: str | None = None
    reward_url: str | None = None
    prompt_key: str | None = None
    output_dir: str = "runs/my_run"


@dataclass
class Starter:
    """The starter config, the changes the plan asked for and the plan's verdict; ``shown``: the sections
    as the starter set them, the keys the YAML shows."""

    config: Config
    shown: dict[str, Any]
    changes: list[str] = field(default_factory=list)
    fits: bool = True
    summary: str = ""


def starter_sections(answers: StarterAnswers) -> dict[str, Any]:
    """The config before sizing: the user's models and data, and the settings a first run usually wants."""
    sources = {"model": answers.reward_model, "function": answers.reward_function, "url": answers.reward_url}
    named = {key: value for key, value in sources.items() if value}
    if len(named) != 1:
        raise LmppoError(
            "name exactly one reward: --reward-model DIR (a learned reward model), --reward-function "
            "module:function (or file.py:function), or --reward-url http://host:port/score (lmppo serve-rm)"
        )
    reward = {"model": {"path": answers.reward_model}} if answers.reward_model else named
    return {
        "models": {
            "policy": {"path": answers.policy},
            "value": {"init_from": "reward" if answers.reward_model else "policy"},
        },
        "reward": reward,
        "data": {"prompts": answers.prompts, "prompt_key": answers.prompt_key},
        "rollout": {"batch_size": 32, "max_new_tokens": _response_budget(answers.policy), "temperature": 0.7},
        "ppo": {"ppo_epochs": 2, "minibatch_size": 16, "lr": 1.0e-5, "target_approx_kl": 0.1},
        "kl": {"beta": 0.05},
        "run": {"steps": 200, "checkpoint_every": 20, "output_dir": answers.output_dir},
    }


def _response_budget(policy: str) -> int:
    """128 new tokens, or a quarter of a short context window (the prompt needs the rest)."""
    from lmppo.loading import load_model_config

    context = getattr(load_model_config(policy), "max_position_embeddings", None) or 4096
    return min(128, context // 4)


def sized_starter(
    answers: StarterAnswers, device: str | None = None, available: int | None = None
) -> Starter:
    """The starter config, with the plan's remedies applied until it fits ``available`` bytes of ``device``
    (default: this machine's device and what it has free)."""
    from lmppo.plan import memory_plan, remedies, size

    raw = starter_sections(answers)

    def planned(change: str = ""):
        """Apply ``change`` (space-separated overrides) to the starter; its config and plan."""
        for override in change.split():
            apply_override(raw, override)
        cfg = validate_config(raw, source="the starter config")
        return cfg, memory_plan(cfg, device=device, available=available)

    cfg, plan = planned()
    first_need, changes = plan.needed_per_rank, []
    policy = next(row for row in plan.models if row.role == "policy")
    if plan.device == "cpu" and policy.parameters > CPU_FULL_TUNING_MAX:  # a speed choice, not memory's
        change = "models.policy_lora.enabled=true models.policy_lora.r=16 ppo.lr=1e-4"
        (cfg, plan), changes = planned(change), [f"{change} (CPU speed)"]
    for _ in range(MAX_REMEDIES):
        fixes = [] if plan.fits else remedies(cfg, plan)
        if not fixes:
            break
        (cfg, plan), changes = planned(fixes[0][0]), [*changes, fixes[0][0]]
    summary = f"needs {size(plan.needed_per_rank)} of {size(plan.available)} on {plan.device}"
    if changes:
        summary += f" (the defaults needed {size(first_need)}; changed: {'; '.join(changes)})"
    return Starter(cfg, raw, changes, plan.fits, summary)


def commented_yaml(starter: Starter) -> str:
    """The config as YAML: the keys the starter set (the user's, the ones a user tunes first, the plan's
    changes), each with its description as a comment; everything else is a default."""
    data = _picked(starter.config.model_dump(mode="json"), starter.shown)
    header = [
        f"# lmppo starter config, written by `lmppo init` on {datetime.date.today()}.",
        f"# Memory plan: {starter.summary}.",
        "# Every key, its default and meaning: docs/config.md. Check it with `lmppo plan THIS_FILE`.",
    ]
    if not starter.fits:
        header.append("# It does NOT fit even so: use a smaller model, more GPUs (FSDP2) or a larger device.")
    return "\n".join([*header, *_lines(data, Config, 0)]) + "\n"


def _picked(full: dict, *keeps: dict) -> dict:
    """``full``'s entries that any of ``keeps`` has (non-null), recursively, in ``full``'s order."""
    picked = {}
    for key, value in full.items():
        kept = [k[key] for k in keeps if isinstance(k, dict) and k.get(key) is not None]
        if not kept:
            continue
        picked[key] = _picked(value, *kept) if isinstance(value, dict) else value
    return picked


def _lines(data: dict[str, Any], model: type[BaseModel], depth: int) -> list[str]:
    lines, indent = [], "  " * depth
    for key, value in data.items():
        info = model.model_fields.get(key)
        section = section_of(info.annotation) if info else None
        if isinstance(value, dict) and section is not None:
            lines.append(f"{indent}{key}:")
            lines += _lines(value, section, depth + 1)
            continue
        text = yaml.safe_dump({key: value}, default_flow_style=True, width=1000).strip()[1:-1]
        note = _short(info.description) if info else ""
        lines.append(f"{indent}{text}" + (f"  # {note}" if note else ""))
    return lines


def _short(description: str | None) -> str:
    """A description's first clause, for a comment."""
    text = " ".join((description or "").split()).split("; ")[0]
    return text if len(text) <= 90 else text[: text.rfind(" ", 0, 88)] + " ..."
