"""Everything a run is built from its config, once: the four models with their identity records, the
reward (a learned reward model with its own tokenizer and template, or a function), and the rollout
engine with its sampling settings (:func:`generator_options`, shared by training and evaluation).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from lmppo.config import Config, RewardComponent, RewardConfig, RewardSource
from lmppo.errors import LmppoError
from lmppo.models import (
    ValueModel,
    enable_gradient_checkpointing,
    freeze,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    make_reference,
    model_identity,
    resolve_source,
    with_lora,
)
from lmppo.rollout import Generator, HFGenerator
from lmppo.scoring import (
    CombinedReward,
    RewardFunction,
    RewardModelScorer,
    ScoredComponent,
    ScoreTransform,
    load_reward_function,
)
from lmppo.spec import check_value_source, policy_spec, resolve_precision, settled_dtype


@dataclass
class PPOModels:
    """The four models of a run (the reward is learned RMs and programs combined, or one function)."""

    policy: nn.Module
    reference: nn.Module
    value: nn.Module
    tokenizer: object
    reward: RewardFunction  # a CombinedReward when built from the config
    identities: dict[str, dict] = field(default_factory=dict)

    @property
    def reward_models(self) -> list[nn.Module]:
        """The frozen networks behind the reward (none for programmatic rewards)."""
        return getattr(self.reward, "models", [])


@dataclass
class LoadedReward:
    """The configured reward: its components combined, and its identity record."""

    reward: CombinedReward
    identity: dict

    def first_model(self) -> ScoredComponent | None:
        """The first learned component (a critic may start from its network)."""
        return next((c for c in self.reward.components if c.model is not None), None)


def score_transform(source: RewardSource) -> ScoreTransform:
    """A reward source's preprocessing: missing-EOS penalty, running normalisation, clip."""
    return ScoreTransform(source.missing_eos_penalty, source.clip, source.normalize)


def load_reward_component(
    source: RewardComponent, where: str, device: torch.device | str, precision: str
) -> tuple[ScoredComponent, dict]:
    """One reward source, scored with its own tokenizer and chat template when learned, and its identity."""
    if source.model is None:
        scorer = load_reward_function(source.function)
        identity = {"role": "reward", "function": source.function}
        return ScoredComponent(source.name, scorer, source.weight, score_transform(source)), identity
    spec = settled_dtype(source.model, f"{where}.model", precision=precision, trained=False)
    tokenizer = load_tokenizer(spec)
    model = load_reward_model(spec).to(device)
    scorer = RewardModelScorer(
        model,
        tokenizer,
        chat_template=spec.chat_template,
        max_length=source.max_length,
        batch_size=source.batch_size,
        batch_tokens=source.batch_tokens,
    )
    identity = model_identity(
        "reward", model, source=resolve_source(spec), tokenizer=tokenizer, chat_template=spec.chat_template
    ).to_dict()
    return ScoredComponent(source.name, scorer, source.weight, score_transform(source), model), identity


def load_reward(
    reward_cfg: RewardConfig, device: torch.device | str = "cpu", precision: str = "fp32"
) -> LoadedReward:
    """``reward.model`` or ``reward.function`` (one source), or every one of ``reward.components``."""
    named = bool(reward_cfg.components)
    loaded = [
        load_reward_component(source, f"reward.components[{i}]" if named else "reward", device, precision)
        for i, source in enumerate(reward_cfg.sources())
    ]
    gate = (reward_cfg.gate.component, reward_cfg.gate.below) if reward_cfg.gate else None
    reward = CombinedReward([component for component, _ in loaded], gate, named)
    if not named:
        return LoadedReward(reward, loaded[0][1])
    identities = {c.name: {**identity, "weight": c.weight} for c, identity in loaded}
    return LoadedReward(reward, {"role": "reward", "components": identities})


def load_value_model(cfg: Config, policy: nn.Module, reward: LoadedReward, tokenizer, device) -> ValueModel:
    """The critic ``models.value`` describes: a head on the policy's trunk, or a separate network."""
    v = cfg.models.value
    if v.mode == "shared":
        return ValueModel.shared_trunk(policy).to(device)
    if v.init_from == "reward":
        learned = reward.first_model()  # there is one: check_value_source ran before any load
        if learned.score.tokenizer.get_vocab() != tokenizer.get_vocab():
            raise LmppoError(
                f"models.value.init_from=reward: the critic reads the policy's token ids, but the reward model "
                f"({learned.name}) has its own tokenizer with another vocabulary; set "
                "models.value.init_from=policy (or models.value.mode=shared)"
            )
        value = ValueModel.from_reward_model(learned.model)
    else:
        value = ValueModel.from_causal_lm(policy)
    # what is trained is fp32 master weights, also when copied from a 16-bit frozen model
    (value.head if v.lora.enabled else value).float()
    return with_lora(value, v.lora).to(device)


def load_policy(cfg: Config, precision: str, device: torch.device | str = "cpu") -> nn.Module:
    """The starting policy: ``models.policy`` with the LoRA adapters of ``models.policy_lora``, if any."""
    return with_lora(load_causal_lm(policy_spec(cfg, precision)).to(device), cfg.models.policy_lora)


def load_models(cfg: Config, device: torch.device) -> PPOModels:
    """Policy (+ LoRA), reference, reward (model or function) and critic, with identity records.

    The order is fixed: LoRA adapters and fresh heads draw their initial weights from the global RNG.
    Weights' dtypes follow ``run.precision`` (:func:`settled_dtype`).
    """
    check_value_source(cfg)
    m = cfg.models
    precision = resolve_precision(cfg.run.precision, device)
    spec = policy_spec(cfg, precision)
    policy_source = resolve_source(spec)
    tokenizer = load_tokenizer(spec)
    policy = load_policy(cfg, precision, device)
    if m.reference is not None:
        reference_spec = settled_dtype(m.reference, "models.reference", precision=precision, trained=False)
        reference_source = resolve_source(reference_spec)
        reference = freeze(load_causal_lm(reference_spec)).to(device)
    else:  # the policy's starting weights: adapter-disabled view with LoRA, else a frozen copy
        reference_source, reference = policy_source, make_reference(policy)
        if precision == "bf16" and not m.policy_lora.enabled:
            reference.to(torch.bfloat16)  # frozen: 2 bytes per parameter
    reward = load_reward(cfg.reward, device, precision)
    value = load_value_model(cfg, policy, reward, tokenizer, device)
    if cfg.ppo.gradient_checkpointing:
        enable_gradient_checkpointing(policy)
        if not value.shared_trunk:
            enable_gradient_checkpointing(value)

    template = m.policy.chat_template
    identities = {
        "policy": model_identity(
            "policy", policy, source=policy_source, tokenizer=tokenizer, chat_template=template
        ).to_dict(),
        "reference": model_identity(
            "reference",
            reference,
            source=reference_source,
            tokenizer=tokenizer,
            chat_template=template,
            shared_with="policy" if m.reference is None else None,
        ).to_dict(),
        "reward": reward.identity,
        "value": model_identity(
            "value", value, shared_with="policy" if value.shared_trunk else None
        ).to_dict(),
    }
    identities["value"]["init_from"] = "policy" if value.shared_trunk else m.value.init_from
    return PPOModels(policy, reference, value, tokenizer, reward.reward, identities)


def generator_options(cfg: Config) -> dict:
    """:class:`~lmppo.rollout.HFGenerator`'s keywords from the config: how training samples, and so how
    every evaluation of the policy samples too."""
    r = cfg.rollout
    return {
        "max_new_tokens": r.max_new_tokens,
        "temperature": r.temperature,
        "top_k": r.top_k,
        "top_p": r.top_p,
        "stop_token_ids": r.stop_token_ids,
        "chat_template": cfg.models.policy.chat_template,
        "raw_prompts": cfg.data.raw_prompts,
        "max_prompt_length": cfg.data.max_prompt_length,
        "truncate_prompts": cfg.data.truncate_prompts,
    }


def build_generator(cfg: Config, models: PPOModels) -> Generator:
    """The rollout engine ``rollout.engine`` names, with the config's sampling settings."""
    if cfg.rollout.engine == "vllm":
        from lmppo.vllm_engine import VLLMGenerator  # vLLM lives in its own environment

        if cfg.models.policy.gguf_file or not Path(cfg.models.policy.path).is_dir():
            raise LmppoError(
                "rollout.engine=vllm loads models.policy.path as a transformers directory; convert a "
                "GGUF file first (lmppo.models.cache_gguf_as_transformers)"
            )
        return VLLMGenerator(
            models.policy,
            models.tokenizer,
            cfg.models.policy.path,
            seed=cfg.run.seed,
            kv_cache_gb=cfg.rollout.vllm_kv_cache_gb,
            weight_sync=cfg.rollout.vllm_weight_sync,
            **generator_options(cfg),
        )
    # A head on the policy's trunk reads its values off the decode loop's hidden states (no values pass);
    # under FSDP2 the head is sharded with the trunk, so the trainer's gathered values pass stays.
    reads_values = getattr(models.value, "shared_trunk", False) and cfg.distributed.strategy != "fsdp2"
    return HFGenerator(
        models.policy,
        models.tokenizer,
        value_model=models.value if reads_values else None,
        bootstrap_values=cfg.rollout.truncation == "bootstrap",  # terminal: the trainer zeroes it anyway
        **generator_options(cfg),
    )
