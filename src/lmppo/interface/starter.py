"""``lmppo init``: a commented starter config for a user's own policy, reward and prompts, sized for this
machine and checked before it is written, so that its first run trains with no edit.

The starter reads the prompts (sizing a step's batch and minibatch to how many there are), tries the reward
(a function or a server is called on two of the prompts; a reward model's config must be a sequence
classifier's), takes the project's defaults for everything else, then asks the plan (:mod:`lmppo.runs.plan`)
whether it fits the device; while it does not, it takes the plan's own first remedy (the seeds' ladder:
LoRA, quantized frozen models, ... then bf16, gradient checkpointing, token budgets) and asks again. On a
CPU a policy above 100M parameters gets LoRA first, for speed, and a LoRA policy's critic is a head on its
trunk (one network to train and save, not a second full copy). Paths are written absolute: a config
means the same files from any working directory. Each line of the YAML carries its key's description.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel

from lmppo.errors import LmppoError, with_context
from lmppo.inputs.config import Config, apply_override, section_of, validate_config

if TYPE_CHECKING:  # the plan imports torch: loaded only when a starter is planned
    from lmppo.runs.plan import MemoryPlan

# On a CPU, full fine-tuning above this many policy parameters takes minutes per step (SmolLM2-135M on
# 2 cores: about 2 min); LoRA trains ~4 % of them and the reference shares the base weights.
CPU_FULL_TUNING_MAX = 100_000_000
MAX_REMEDIES = 8  # the ladder has fewer rungs than this; a plan still too large after them is reported
# A step's prompts and the responses an optimizer step averages over, when the prompts allow
BATCH_SIZE, MINIBATCH_SIZE = 32, 16
PLACEHOLDER_RESPONSE = "I am not sure."  # what the reward is tried on: any text a policy could answer
DEFAULT_TURNS = 4  # rollout.max_turns' default: an episode's turns when the context window has room
MIN_EPISODE_TOKENS = 16  # fewer tokens than this after the longest prompt: no episode worth playing


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
    environment: str | None = None  # rollout.environment: episodes, each turn answered by it
    tools: list[str] = field(default_factory=list)  # rollout.tools

    @property
    def episodes(self) -> bool:
        return self.environment is not None or bool(self.tools)


@dataclass
class Starter:
    """The starter config, the changes the plan asked for and the plan's verdict; ``shown``: the sections
    as the starter set them, the keys the YAML shows."""

    config: Config
    shown: dict[str, Any]
    changes: list[str] = field(default_factory=list)
    fits: bool = True
    summary: str = ""


def starter_sections(answers: StarterAnswers, prompt_count: int) -> dict[str, Any]:
    """The config before sizing: the user's models and data (absolute paths), the batch sized to
    ``prompt_count`` prompts, and the settings a first run usually wants."""
    from lmppo.inputs.resolve import fitted_batches

    sections = {
        "models": {
            "policy": {"path": absolute(answers.policy)},
            "value": {"init_from": _critic_backbone(answers)},
        },
        "reward": _starter_reward(answers),
        "data": {"prompts": absolute(answers.prompts), "prompt_key": answers.prompt_key},
        "rollout": {
            "batch_size": BATCH_SIZE,
            "max_new_tokens": _response_budget(answers.policy),
            "temperature": 0.7,
            **_episode_sections(answers),
        },
        "ppo": {"ppo_epochs": 2, "minibatch_size": MINIBATCH_SIZE, "lr": 1.0e-5, "target_approx_kl": 0.1},
        "kl": {"beta": 0.05},
        "run": {"steps": 200, "checkpoint_every": 20, "output_dir": str(Path(answers.output_dir).resolve())},
    }
    if sections["reward"] is None:  # the environment's rewards alone: the config has no reward section
        del sections["reward"]
    batch, minibatch = fitted_batches(validate_config(sections), prompt_count)
    sections["rollout"]["batch_size"], sections["ppo"]["minibatch_size"] = batch, minibatch
    return sections


def _starter_reward(answers: StarterAnswers) -> dict[str, Any] | None:
    """The one reward named; none when an environment (or tools) is named, whose rewards are then the run's."""
    sources = {"model": answers.reward_model, "function": answers.reward_function, "url": answers.reward_url}
    named = {key: value for key, value in sources.items() if value}
    if len(named) > 1 or not (named or answers.episodes):
        raise LmppoError(
            "name exactly one reward: --reward-model DIR (a learned reward model), --reward-function "
            "module:function (or file.py:function), or --reward-url http://host:port/score (lmppo serve-rm); "
            "with --environment (or --tools) the reward may also be the environment's alone"
        )
    if answers.reward_model:
        return {"model": {"path": absolute(answers.reward_model)}}
    if answers.reward_function:
        return {"function": absolute_function(answers.reward_function)}
    return named or None


def _episode_sections(answers: StarterAnswers) -> dict[str, Any]:
    """``rollout.environment`` and ``rollout.tools`` as given, file paths made absolute (the episode budget
    is sized later, once the prompts are rendered)."""
    sections: dict[str, Any] = {}
    if answers.environment:
        sections["environment"] = absolute_function(answers.environment)
    if answers.tools:
        sections["tools"] = [_absolute_tool(tool) for tool in answers.tools]
    return sections


def _absolute_tool(spec: str) -> str:
    """A tool's spec with a ``file.py`` made absolute; an MCP server's command or URL as given."""
    if spec.startswith(("mcp:", "http://", "https://")):
        return spec
    return absolute_function(spec)


def _critic_backbone(answers: StarterAnswers) -> str:
    """A separate critic starts from the reward model (it already reads responses for their value) when
    that reads the policy's tokens: the critic sees the policy's token ids. Otherwise from the policy."""
    from lmppo.modeling.loading import load_tokenizer

    if not answers.reward_model:
        return "policy"
    same = load_tokenizer(answers.reward_model).get_vocab() == load_tokenizer(answers.policy).get_vocab()
    return "reward" if same else "policy"


def absolute(path: str) -> str:
    """A local file or directory as an absolute path; anything else (a hub id) as given."""
    local = Path(path).expanduser()
    return str(local.resolve()) if local.exists() else path


def absolute_function(spec: str) -> str:
    """``file.py:function`` with the file's absolute path; ``module:function`` as given."""
    module, _, function = spec.rpartition(":")
    return f"{absolute(module)}:{function}" if module.endswith(".py") else spec


def _response_budget(policy: str) -> int:
    """128 new tokens, or a quarter of a short context window (the prompt needs the rest)."""
    from lmppo.modeling.loading import load_model_config

    context = getattr(load_model_config(policy), "max_position_embeddings", None) or 4096
    return min(128, context // 4)


def starter_prompts(answers: StarterAnswers) -> list:
    """The prompts, read as a run reads them; a bad column is named by ``--prompt-key``."""
    from lmppo.inputs.data import load_prompts

    return load_prompts(answers.prompts, key=answers.prompt_key, knob="--prompt-key")


def check_reward(cfg: Config, prompts: list) -> None:
    """Try the reward before the config is written: a function or a server scores two of the prompts
    with a placeholder response (finite, one score each); a reward model's config must be a scorer's."""
    from lmppo.inputs.resolve import reward_roles
    from lmppo.modeling.loading import check_reward_model
    from lmppo.runs.build import load_reward_component

    if not cfg.reward.sources():  # the environment's rewards alone
        return
    source, role = cfg.reward.sources()[0], reward_roles(cfg.reward, "fp32")[0]
    if source.model is not None:
        check_reward_model(source.model)
        return
    component, _ = load_reward_component(source, role, "cpu")
    sample = prompts[:2]
    try:
        component.checked_scores(sample, [PLACEHOLDER_RESPONSE] * len(sample))
    except LmppoError as err:
        raise with_context(
            err,
            f"lmppo init tried the reward on the first {len(sample)} prompts with the response "
            f"{PLACEHOLDER_RESPONSE!r}; nothing was written",
        ) from None


def episode_budget(cfg: Config, answers: StarterAnswers, prompts: list) -> dict[str, int]:
    """The environment tried (:func:`check_environment`), then ``max_new_tokens``, ``max_turns`` and
    ``max_total_tokens`` for episodes in the policy's context window: an episode takes what the longest
    prompt leaves (rendered with the tools' schemas), at most ``DEFAULT_TURNS`` turns of the starter's new
    tokens (fewer, or shorter turns, when the window is small)."""
    from lmppo.inputs.data import render_query_ids
    from lmppo.modeling.loading import load_model_config, load_tokenizer
    from lmppo.runs.build import run_environment

    tokenizer = load_tokenizer(answers.policy)
    environment, tools = run_environment(cfg, tokenizer)
    check_environment(cfg, environment, answers)
    context = getattr(load_model_config(answers.policy), "max_position_embeddings", None) or 4096
    longest = max(len(render_query_ids(tokenizer, prompt, tools=tools)) for prompt in prompts)
    room = context - longest
    if room < MIN_EPISODE_TOKENS:
        bare = max(len(render_query_ids(tokenizer, prompt)) for prompt in prompts) if tools else longest
        schemas = f", {longest - bare} of them the tool schemas" if tools else ""
        raise LmppoError(
            f"the longest prompt renders to {longest} tokens{schemas}, of the policy's {context}-token context "
            f"window, leaving {room} for an episode's turns; shorten the prompts"
            + (" or the tools' docstrings, name fewer tools" if tools else "")
            + " (or use a model with a longer window)"
        )
    new = min(cfg.rollout.max_new_tokens, room)
    turns = max(1, min(DEFAULT_TURNS, room // new))
    return {"max_new_tokens": new, "max_turns": turns, "max_total_tokens": min(room, DEFAULT_TURNS * new)}


def check_environment(cfg: Config, environment: type, answers: StarterAnswers) -> None:
    """Try the environment before the config is written: made and reset on the first two prompt rows."""
    from lmppo.errors import user_code_error
    from lmppo.inputs.data import load_prompt_rows
    from lmppo.sampling.engines import sample_seed

    rows = load_prompt_rows(answers.prompts)[:2]
    for sample_id, row in enumerate(rows):
        try:
            environment().reset(dict(row), sample_seed(cfg.run.seed, sample_id))
        except LmppoError as err:
            raise with_context(err, _TRIED_ENVIRONMENT.format(len(rows))) from None
        except Exception as err:
            what = f"rollout.environment {cfg.rollout.environment or 'of rollout.tools'} (reset)"
            raise with_context(user_code_error(what, err), _TRIED_ENVIRONMENT.format(len(rows))) from None


_TRIED_ENVIRONMENT = (
    "lmppo init made the environment and reset it on the first {} prompt rows; nothing was written"
)


def sized_starter(
    answers: StarterAnswers, device: str | None = None, available: int | None = None
) -> Starter:
    """The starter config, checked, with the plan's remedies applied until it fits ``available`` bytes of
    ``device`` (default: this machine's device and what it has free)."""
    from lmppo.progress import size
    from lmppo.runs.plan import memory_plan, remedies

    prompts = starter_prompts(answers)
    raw = starter_sections(answers, len(prompts))
    if answers.episodes:
        raw["rollout"].update(
            episode_budget(validate_config(raw, source="the starter config"), answers, prompts)
        )
    check_reward(validate_config(raw, source="the starter config"), prompts)

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
    if _full_critic_beside_lora(cfg, plan):
        change = "models.value.mode=shared"
        (cfg, plan), changes = planned(change), [*changes, f"{change} (the critic of a LoRA policy)"]
    summary = f"needs {size(plan.needed_per_rank)} of {size(plan.available)} on {plan.device}"
    if changes:
        summary += f" (the defaults needed {size(first_need)}; changed: {'; '.join(changes)})"
    return Starter(cfg, raw, changes, plan.fits, summary)


def _full_critic_beside_lora(cfg: Config, plan: MemoryPlan) -> bool:
    """A LoRA policy with a separate, fully trained critic: the critic would cost more than the policy (its
    weights, gradients and Adam state, and a second network's passes); a head on the trunk costs nearly
    nothing, and that is what the SmolLM2 measurements ran (docs/quality.md)."""
    value = cfg.models.value
    return (
        cfg.models.policy_lora.enabled and plan.critic and value.mode == "separate" and not value.lora.enabled
    )


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
