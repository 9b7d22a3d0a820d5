"""The schema's keys as dotted paths: the section a field holds, a key's default, and the key an unknown
one most likely meant: a misspelling, a key of ours in another section, or another trainer's name for it
(``learning_rate`` -> ``ppo.lr``)."""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterator
from typing import Any, get_args, get_origin

from pydantic import BaseModel

from lmppo.inputs.config.schema import Config
from lmppo.inputs.config.section import Section

# Names users bring from TRL (PPOConfig old and new, GRPOConfig, ModelConfig, transformers'
# TrainingArguments), OpenRLHF and verl, with the key of ours that means the same: an unknown key of that
# name suggests ours. A "section.name" entry applies in that section only, where the trainers disagree:
# TRL's target_kl stops the PPO epochs early, verl's kl_ctrl.target_kl is the adaptive controller's target;
# OpenRLHF's train_batch_size counts the responses of an optimizer step, verl's data.train_batch_size the
# prompts of a step. Left out for want of an equivalent: TRL's total_episodes (ours: run.steps x
# rollout.batch_size), num_mini_batches (a count; ours is a size), whiten_rewards (reward.normalize keeps
# running statistics of the raw score instead); verl's ppo_mini_batch_size (counts prompts, ours
# responses); per-GPU batch sizes (ours are global).
OTHER_TRAINERS_KEYS = {
    "model_name_or_path": "models.policy.path",
    "sft_model_path": "models.policy.path",
    "pretrain": "models.policy.path",
    "use_peft": "models.policy_lora.enabled",
    "lora_r": "models.policy_lora.r",
    "lora_rank": "models.policy_lora.r",
    "lora_alpha": "models.policy_lora.alpha",
    "lora_dropout": "models.policy_lora.dropout",
    "lora_target_modules": "models.policy_lora.target_modules",
    "custom_chat_template": "models.policy.chat_template",
    "reward_model_path": "reward.model.path",
    "critic_pretrain": "models.value.path",  # OpenRLHF's critic to start from
    "reward_pretrain": "reward.model.path",
    "remote_rm_url": "reward.url",
    "score_clip": "reward.clip",
    "prompt_data": "data.prompts",
    "train_files": "data.prompts",
    "input_key": "data.prompt_key",
    "eval_dataset": "data.eval_prompts",
    "val_files": "data.eval_prompts",
    "prompt_max_len": "data.max_prompt_length",
    "batch_size": "rollout.batch_size",  # TRL's responses per step (one per prompt), not reward.batch_size
    "rollout_batch_size": "rollout.batch_size",
    "data.train_batch_size": "rollout.batch_size",
    "num_generations": "rollout.samples_per_prompt",
    "n_samples_per_prompt": "rollout.samples_per_prompt",
    "rollout.n": "rollout.samples_per_prompt",
    "response_length": "rollout.max_new_tokens",
    "max_response_length": "rollout.max_new_tokens",
    "max_completion_length": "rollout.max_new_tokens",
    "generate_max_len": "rollout.max_new_tokens",
    "max_length": "rollout.max_new_tokens",  # generate()'s counts the prompt too; the nearest we have
    "stop_token_id": "rollout.stop_token_ids",
    "adv_estimator": "ppo.advantage",
    "advantage_estimator": "ppo.advantage",
    "num_ppo_epochs": "ppo.ppo_epochs",
    "max_epochs": "ppo.ppo_epochs",
    "mini_batch_size": "ppo.minibatch_size",
    "train_batch_size": "ppo.minibatch_size",
    "cliprange": "ppo.clip_eps",
    "eps_clip": "ppo.clip_eps",
    "clip_ratio": "ppo.clip_eps",
    "clip_ratio_high": "ppo.clip_eps_high",  # verl (DAPO's clip-higher)
    "clip_ratio_low": "ppo.clip_eps",
    "clip_eps_low": "ppo.clip_eps",
    "filter_groups": "rollout.dynamic_sampling",  # verl (DAPO's dynamic sampling)
    "max_num_gen_batches": "rollout.dynamic_sampling_rounds",
    "eps_clip_high": "ppo.clip_eps_high",
    "cliprange_high": "ppo.clip_eps_high",
    "actor_lambda": "ppo.lam_policy",
    "lam_actor": "ppo.lam_policy",
    "critic_lambda": "ppo.lam_critic",
    "value_pretrain_steps": "ppo.critic_warmup_steps",
    "cliprange_value": "ppo.value_clip_eps",
    "value_clip": "ppo.value_clip_eps",
    "entropy_coeff": "ppo.ent_coef",
    "entropy_loss_coef": "ppo.ent_coef",
    "lambd": "ppo.lam",
    "target_kl": "ppo.target_approx_kl",
    "max_norm": "ppo.max_grad_norm",
    "grad_clip": "ppo.max_grad_norm",
    "learning_rate": "ppo.lr",
    "actor_learning_rate": "ppo.lr",
    "critic_learning_rate": "ppo.value_lr",
    "l2": "ppo.weight_decay",
    "adam_epsilon": "ppo.adam_eps",
    "lr_scheduler_type": "ppo.lr_schedule",
    "lr_scheduler": "ppo.lr_schedule",
    "lr_warmup_steps": "ppo.warmup_steps",
    "freezing_actor_steps": "ppo.critic_warmup_steps",
    "critic_warmup": "ppo.critic_warmup_steps",
    "loss_agg_mode": "ppo.loss_aggregation",
    "enable_gradient_checkpointing": "ppo.gradient_checkpointing",
    "kl_coef": "kl.beta",
    "init_kl_coef": "kl.beta",
    "kl_loss_coef": "kl.beta",
    "use_kl_loss": "kl.in_loss",
    "kl_estimator": "kl.estimator",
    "adap_kl_ctrl": "kl.adaptive",
    "kl_target": "kl.target",
    "kl.target_kl": "kl.target",
    "kl_horizon": "kl.horizon",
    "save_path": "run.output_dir",
    "max_steps": "run.steps",
    "total_training_steps": "run.steps",
    "save_steps": "run.checkpoint_every",
    "save_freq": "run.checkpoint_every",
    "save_total_limit": "run.keep_last",
    "max_ckpt_num": "run.keep_last",
    "eval_steps": "run.eval_every",
    "test_freq": "run.eval_every",
    "report_to": "logging.sinks",
    "exp_name": "logging.run_name",
    "experiment_name": "logging.run_name",
    "wandb_run_name": "logging.run_name",
}


def unknown_key_hint(loc: list[str], schema: type[Section]) -> str:
    """The key an unknown key at ``loc`` most likely meant, else its section's valid keys."""
    meant = _meant_key(loc, schema)
    if meant:
        return f"did you mean {meant!r}?"
    valid = _valid_keys(loc[:-1], schema)
    near = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.5)  # a misspelling in its own section
    return f"did you mean {'.'.join(loc[:-1] + near)!r}?" if near else f"valid keys here: {', '.join(valid)}"


def _meant_key(loc: list[str], schema: type[Section]) -> str | None:
    """The full key another trainer's name for ``loc`` means, or a key of ours of that name in another
    section: of those, the one sharing the most sections with ``loc`` (a key one level too deep finds its
    own), the other trainer's meaning first when none is nearer."""
    section, name = loc[:-1], loc[-1]
    foreign = OTHER_TRAINERS_KEYS.get(".".join(loc[-2:])) or OTHER_TRAINERS_KEYS.get(name)
    tails = [tail for tail in (foreign, name) if tail]
    keys = [key for tail in tails for key in _full_keys(schema) if key == tail or key.endswith(f".{tail}")]
    return max(keys, key=lambda key: len(os.path.commonprefix([key.split("."), section])), default=None)


def _full_keys(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    """Every key of ``model`` as a dotted path, into nested and optional sections but not into lists (an
    item's key needs its index)."""
    for name, field in model.model_fields.items():
        yield prefix + name
        section = section_of(field.annotation)
        if section is not None and get_origin(field.annotation) is not list:
            yield from _full_keys(section, f"{prefix}{name}.")


def _valid_keys(loc: list[str], schema: type[Section]) -> list[str]:
    """Field names of the section at ``loc`` (following nested sections, optional sections and list items)."""
    model: type[BaseModel] | None = schema
    for part in loc:
        if part.isdigit():  # an item of a list of sections (reward.components.0): the item's keys
            continue
        field = model.model_fields.get(part)
        model = section_of(field.annotation) if field else None
        if model is None:
            return []
    return list(model.model_fields)


def section_of(annotation: Any) -> type[BaseModel] | None:
    """The section class a field holds (itself, optional, or a list of it), else None."""
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
        if get_origin(candidate) is list:
            return section_of(get_args(candidate)[0])
    return None


NO_DEFAULT = object()


def schema_default(key: str, schema: type[BaseModel] = Config) -> Any:
    """The JSON default of the dotted ``key`` (``ppo.lam_policy``), or :data:`NO_DEFAULT` where there is
    none (an unknown or required key, a key inside a list item or an optional section)."""
    model: type[BaseModel] | None = schema
    *sections, name = key.split(".")
    for part in sections:
        field = model.model_fields.get(part) if model else None
        if field is None or field.default is None or get_origin(field.annotation) is list:
            return NO_DEFAULT
        model = section_of(field.annotation)
    field = model.model_fields.get(name) if model else None
    if field is None or field.is_required():
        return NO_DEFAULT
    default = field.get_default(call_default_factory=True)
    return default.model_dump(mode="json") if isinstance(default, BaseModel) else _json(default)


def _json(value: Any) -> Any:
    """Tuples as lists, as a saved manifest holds them."""
    return [_json(v) for v in value] if isinstance(value, tuple | list) else value
