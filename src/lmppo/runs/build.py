"""Everything a run is built from its config, once: the four models with their identity records, the
reward (a learned reward model with its own tokenizer and template, or a function), and the rollout
engine with its sampling settings (:func:`generator_options`, shared by training and evaluation).
"""

from __future__ import annotations

import atexit
import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lmppo.errors import LmppoError
from lmppo.inputs.config import Config, KLConfig, PPOConfig, RewardComponent, RewardConfig, RewardSource
from lmppo.inputs.data import Prompt, PromptStream
from lmppo.inputs.resolve import RoleSpec, RunSpec, episode_environment
from lmppo.math import core
from lmppo.modeling.compile import compile_layers
from lmppo.modeling.distributed import CommCounter, data_parallel, shard_models
from lmppo.modeling.loading import (
    DTYPES,
    freeze,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    resolve_source,
    weight_files,
)
from lmppo.modeling.lora import (
    inputs_left_to_autocast,
    make_reference,
    unwrap_model,
    with_lora,
    without_adapters,
)
from lmppo.modeling.models import (
    PPOModels,
    ValueModel,
    enable_gradient_checkpointing,
    make_value_model,
    model_identity,
    saved_critic_identity,
    trainable_parameters,
)
from lmppo.modeling.quantize import offload
from lmppo.progress import phase, size
from lmppo.rewards.remote_reward import RemoteReward
from lmppo.rewards.scoring import (
    CombinedReward,
    RewardModelScorer,
    ScoredComponent,
    ScoreTransform,
    load_reward_function,
    no_reward,
)
from lmppo.sampling.engines import Generator
from lmppo.sampling.environments import load_environment, with_toolbox
from lmppo.sampling.episodes import EpisodeGenerator
from lmppo.sampling.hf_engine import hf_generator
from lmppo.sampling.passes import PolicyAndValue
from lmppo.sampling.responses import ResponseGenerator
from lmppo.sampling.tools import Toolbox, open_toolbox
from lmppo.training.base import Trainer, TrainerParts
from lmppo.training.best_of_n import BestOfNTrainer
from lmppo.training.trainer import PPOTrainer


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
    source: RewardComponent, role: RoleSpec, device: torch.device | str
) -> tuple[ScoredComponent, dict]:
    """One reward source, scored with its own tokenizer and chat template when learned, and its identity."""
    model = None
    if source.url is not None:  # a reward server: its model is its own business
        scorer = RemoteReward(
            source.url,
            batch_size=source.batch_size,
            timeout_s=source.url_timeout_s,
            retries=source.url_retries,
            token_env=source.url_token_env,
            proxy=source.url_proxy,
        )
        identity, named = {"role": "reward", "url": source.url}, f"the reward server {source.url}"
    elif role.source is None:
        scorer = load_reward_function(source.function)
        identity, named = (
            {"role": "reward", "function": source.function},
            f"reward function {source.function}",
        )
    else:
        scorer, model, identity = _reward_model_scorer(source, role, device)
        named = f"reward model {role.source.path}"
    transform = score_transform(source)
    return ScoredComponent(source.name, scorer, source.weight, transform, model, named), identity


def _reward_model_scorer(
    source: RewardComponent, role: RoleSpec, device: torch.device | str
) -> tuple[RewardModelScorer, nn.Module, dict]:
    """A learned reward: its scorer (own tokenizer and template), the frozen model and its identity."""
    with phase(f"loading the reward model: {on_disk(resolve_source(role.source))}"):
        tokenizer = load_tokenizer(role.source)
        model = placed(load_reward_model(role.source), role, device)
    scorer = RewardModelScorer(
        model,
        tokenizer,
        chat_template=role.source.chat_template,
        max_length=source.max_length,
        batch_size=source.batch_size,
        batch_tokens=source.batch_tokens,
    )
    identity = model_identity(
        "reward",
        model,
        source=resolve_source(role.source),
        tokenizer=tokenizer,
        chat_template=role.source.chat_template,
    ).to_dict()
    return scorer, model, identity


def load_reward(
    reward_cfg: RewardConfig, roles: tuple[RoleSpec, ...], device: torch.device | str = "cpu"
) -> LoadedReward:
    """``reward.model`` or ``reward.function`` (one source), or every one of ``reward.components``, as
    their ``roles`` (:func:`lmppo.inputs.resolve.reward_roles`) say; with no source, a final reward of 0."""
    if not reward_cfg.configured:  # an environment's turn rewards are the whole reward
        zero = ScoredComponent("reward", no_reward, transform=score_transform(reward_cfg), source="no reward")
        return LoadedReward(CombinedReward([zero]), {"role": "reward", "function": None})
    named = bool(reward_cfg.components)
    loaded = [
        load_reward_component(source, role, device)
        for source, role in zip(reward_cfg.sources(), roles, strict=True)
    ]
    gate = (reward_cfg.gate.component, reward_cfg.gate.below) if reward_cfg.gate else None
    reward = CombinedReward([component for component, _ in loaded], gate, named)
    if not named:
        return LoadedReward(reward, loaded[0][1])
    identities = {c.name: {**identity, "weight": c.weight} for c, identity in loaded}
    return LoadedReward(reward, {"role": "reward", "components": identities})


def load_value_model(
    role: RoleSpec, policy: nn.Module, reward: LoadedReward, tokenizer, device
) -> ValueModel:
    """The critic ``role`` describes: a head on the policy's trunk, or a separate network."""
    learned = reward.first_model()  # there is one when init_from=reward: resolve checked it before any load
    if role.init_from == "reward" and learned.score.tokenizer.get_vocab() != tokenizer.get_vocab():
        raise LmppoError(
            f"models.value.init_from=reward: the critic reads the policy's token ids, but the reward model "
            f"({learned.name}) has its own tokenizer with another vocabulary; set "
            "models.value.init_from=policy (or models.value.mode=shared)"
        )
    return make_value_model(role, policy, learned.model if learned else None).to(device)


def load_policy(role: RoleSpec, device: torch.device | str = "cpu") -> nn.Module:
    """The starting policy ``role`` describes, with its LoRA adapters if any."""
    return with_lora(load_causal_lm(role.source).to(device), role.lora)


def load_reference(role: RoleSpec, policy: nn.Module, device: torch.device | str) -> nn.Module:
    """Its own frozen model, or the policy's starting weights: the adapter-disabled view with LoRA, else a
    frozen copy in the role's dtype."""
    if role.source is not None:
        return placed(freeze(load_causal_lm(role.source)), role, device)
    reference = make_reference(policy)
    if role.copy_of:
        reference.to(DTYPES[role.dtype])  # frozen: 2 bytes per parameter under bf16
    return reference


def placed(model: nn.Module, role: RoleSpec, device: torch.device | str) -> nn.Module:
    """A frozen model on ``device``, or kept in host memory when its section offloads it (its passes then
    run inside :func:`lmppo.modeling.distributed.gathered`, which brings it over)."""
    if role.source.offload == "none":
        return model.to(device)
    return offload(model, role.source.offload, torch.device(device))


def on_disk(source) -> str:
    """A model's files and their size, for the console (size first: a narrow terminal cuts the end)."""
    return f"{size(sum(f.stat().st_size for f in weight_files(source)))} from {source}"


def reference_origin(role: RoleSpec) -> str:
    """Where the reference's weights come from, for the console."""
    if role.source is not None:
        return f": {on_disk(resolve_source(role.source))}"
    return " (the policy with its adapters off)" if role.shares else " (a frozen copy of the policy)"


def load_models(cfg: Config, spec: RunSpec) -> PPOModels:
    """Policy (+ LoRA), reference, reward (model or function) and critic as ``spec`` describes them, with
    identity records.

    The order is fixed: LoRA adapters and fresh heads draw their initial weights from the global RNG.
    """
    device = spec.device
    policy_source = resolve_source(spec.policy.source)
    with phase(f"loading the policy: {on_disk(policy_source)}"):
        tokenizer = load_tokenizer(spec.policy.source)
        policy = load_policy(spec.policy, device)
    with phase(f"loading the reference{reference_origin(spec.reference)}"):
        reference = load_reference(spec.reference, policy, device)
    reward = load_reward(cfg.reward, spec.rewards, device)
    value = None
    if spec.value:
        with phase(f"building the critic ({spec.value.note or 'a head on the policy'})"):
            value = load_value_model(spec.value, policy, reward, tokenizer, device)
    if spec.precision == "bf16":  # every pass of these models runs under autocast
        inputs_left_to_autocast(policy, *([value] if value is not None else []))
    if cfg.ppo.gradient_checkpointing:
        enable_gradient_checkpointing(policy)
        if value is not None and not value.shared_trunk:
            enable_gradient_checkpointing(value)
    reference_source = resolve_source(spec.reference.source) if spec.reference.source else policy_source
    template = cfg.models.policy.chat_template
    with phase("recording each model's identity (hashing its weight files)"):
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
                shared_with=None if spec.reference.source else "policy",
            ).to_dict(),
            "reward": reward.identity,
        }
        if value is not None:  # a critic-free run records no critic
            shared_with = "policy" if value.shared_trunk else None
            identities["value"] = model_identity("value", value, shared_with=shared_with).to_dict()
            identities["value"]["init_from"] = spec.value.init_from or "policy"
            if spec.value.saved:  # started from a critic an earlier run saved
                identities["value"]["init_from"] = "saved"
                identities["value"]["saved"] = saved_critic_identity(spec.value.saved)
    return PPOModels(policy, reference, value, tokenizer, reward.reward, identities)


def generator_options(cfg: Config) -> dict:
    """:func:`~lmppo.sampling.hf_engine.hf_generator`'s keywords from the config: how training samples, and
    so how every evaluation of the policy samples too."""
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
        "batch_tokens": r.generation_batch_tokens,
    }


def build_generator(cfg: Config, spec: RunSpec, models: PPOModels) -> Generator:
    """The rollout engine ``rollout.engine`` names, with the config's sampling settings; with
    ``rollout.asynchronous`` the transformers decode loop runs on its own copy of the policy; with
    ``rollout.environment`` it samples each turn of an episode."""
    engine = spec.engine
    if engine.kind == "vllm":
        return configured_vllm(cfg, spec, models.policy, models.tokenizer, dtype=spec.compute_dtype)
    if engine.asynchronous:  # a plain copy of the starting policy (before any sharding)
        snapshot = without_adapters(copy.deepcopy(unwrap_model(models.policy)))
        generator = hf_generator(
            snapshot, models.tokenizer, seed=cfg.run.seed, owns_weights=True, **generator_options(cfg)
        )
        return with_environment(cfg, spec, generator)
    generator = hf_generator(
        models.policy,
        models.tokenizer,
        value_model=models.value if engine.values_from_decode else None,
        bootstrap_values=engine.bootstrap_values,
        **generator_options(cfg),
    )
    return with_environment(cfg, spec, generator)


def policy_generator(cfg: Config, spec: RunSpec, policy: nn.Module, tokenizer) -> Generator:
    """How training samples, on the decode loop over ``policy``: the pre-flight's and an evaluation's
    generator when the run's own engine is not at hand."""
    return with_environment(cfg, spec, hf_generator(policy, tokenizer, **generator_options(cfg)))


def with_environment(cfg: Config, spec: RunSpec, generator: ResponseGenerator) -> Generator:
    """``generator``'s engine playing the run's episodes, when it has any (``rollout.environment``,
    ``rollout.tools``; training, its pre-flight and both evaluations sample alike). With tools the renderer
    renders their schemas and the environment answers them from the process's toolbox."""
    if spec.engine.environment is None:
        return generator
    environment, generator.renderer.tools = run_environment(cfg, generator.renderer.tokenizer)
    episodes = ToolEpisodes if cfg.rollout.tools else EpisodeGenerator
    return episodes(
        generator.engine,
        generator.renderer,
        environment,
        name=spec.engine.environment,
        max_turns=cfg.rollout.max_turns,
        max_total_tokens=spec.engine.max_episode_tokens,
        seed=cfg.run.seed,
        environment_workers=cfg.rollout.environment_workers,
        environment_timeout_s=cfg.rollout.environment_timeout_s,
    )


def run_environment(cfg: Config, tokenizer) -> tuple[type, list[dict] | None]:
    """The environment class the run's episodes play (``rollout.environment``, or a ToolEnvironment for
    ``rollout.tools`` alone) and the tool schemas its prompts render (None without ``rollout.tools``); calls
    are read in the format ``tokenizer`` parses."""
    environment = load_environment(episode_environment(cfg))
    if not cfg.rollout.tools:
        return environment, None
    toolbox = process_toolbox(cfg.rollout.tools, cfg.rollout.environment_timeout_s)
    return with_toolbox(environment, toolbox, tokenizer), toolbox.schemas()


def run_tool_schemas(cfg: Config, tokenizer) -> list[dict] | None:
    """The schemas every rendering of the run carries (None without ``rollout.tools``), the environment
    checked to answer them; the toolbox (its MCP servers) started once per process."""
    return run_environment(cfg, tokenizer)[1] if cfg.rollout.tools else None


_TOOLBOXES: dict[tuple[tuple[str, ...], float], Toolbox] = {}  # one per process and rollout.tools


def process_toolbox(specs: list[str], timeout_s: float) -> Toolbox:
    """The toolbox of ``rollout.tools``, started once per process (its MCP servers checked then, before
    step 1) and shared by every generator of the run, until :func:`close_toolboxes`."""
    key = (tuple(specs), timeout_s)
    if key not in _TOOLBOXES:
        _TOOLBOXES[key] = open_toolbox(specs, timeout_s)
    return _TOOLBOXES[key]


def close_toolboxes() -> None:
    """Close the toolboxes this process started (its MCP servers stop); a later generator starts anew."""
    while _TOOLBOXES:
        _TOOLBOXES.popitem()[1].close()


atexit.register(close_toolboxes)  # a generator never closed (a pre-flight's) leaves no server behind


class ToolEpisodes(EpisodeGenerator):
    """Episodes answered from the process's toolbox, closed with the engine when the run ends."""

    def close(self, abandon: bool = False) -> None:
        super().close(abandon)
        close_toolboxes()


def configured_vllm(cfg: Config, spec: RunSpec, policy: nn.Module, tokenizer, *, dtype=None) -> Generator:
    """A vLLM engine loaded from ``models.policy.path``, sampling as the config says, synced and put to
    sleep as ``spec.engine`` says, in ``dtype`` (the run's compute dtype; None: the policy's)."""
    from lmppo.sampling.vllm_engine import vllm_generator  # vLLM lives in its own environment

    options = generator_options(cfg)
    del options["batch_tokens"]  # the decode loop's: vLLM batches by its own KV cache
    generator = vllm_generator(
        policy,
        tokenizer,
        cfg.models.policy.path,
        seed=cfg.run.seed,
        kv_cache_gb=cfg.rollout.vllm_kv_cache_gb,
        weight_sync=spec.engine.weight_sync,
        dtype=dtype,
        sleep=spec.engine.sleeps,
        max_response_tokens=spec.engine.max_episode_tokens,
        **options,
    )
    return with_environment(cfg, spec, generator)


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """LR multiplier per PPO step: linear warmup, then constant / linear / cosine decay to 0."""

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        if schedule == "linear":
            return max(0.0, 1.0 - progress)
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
        return 1.0

    return multiplier


def build_optimizer(ppo: PPOConfig, models: PPOModels) -> torch.optim.Optimizer:
    """AdamW over the policy's trained parameters and the critic's own (with a shared trunk: the head);
    a critic-free run has the policy's group alone."""
    groups = [{"params": trainable_parameters(models.policy), "lr": ppo.lr, "name": "policy"}]
    if models.value is not None:
        policy_ids = {id(p) for p in models.policy.parameters()}
        value_params = [p for p in trainable_parameters(models.value) if id(p) not in policy_ids]
        groups.append({"params": value_params, "lr": ppo.value_lr or ppo.lr, "name": "value"})
    # fused: one kernel per step instead of a dozen foreach passes over every parameter (as TRL's default)
    return torch.optim.AdamW(groups, weight_decay=ppo.weight_decay, eps=ppo.adam_eps, fused=True)


def build_kl_controller(kl: KLConfig) -> core.FixedKLController:
    """The fixed coefficient, or the adaptive controller that steers the KL toward ``kl.target``."""
    return (
        core.AdaptiveKLController(kl.beta, kl.target, kl.horizon)
        if kl.adaptive
        else core.FixedKLController(kl.beta)
    )


def build_update_module(
    spec: RunSpec, models: PPOModels, group: torch.distributed.ProcessGroup | None
) -> tuple[nn.Module, CommCounter | None]:
    """The update's forward over policy and critic. Several ranks under DDP: wrapped to sync gradients in
    the backward (generation and the stored passes use the plain modules). FSDP2: the models themselves
    are sharded, in place (every pass outside the update gathers them)."""
    train_module = PolicyAndValue(models.policy, models.value)
    if spec.sharded:
        learned = [role for role in spec.rewards if role.source is not None]
        frozen = [(spec.reference, models.reference), *zip(learned, models.reward_models, strict=True)]
        return train_module, shard_models(spec, group, models.policy, models.value, frozen)
    if group is not None:
        return data_parallel(train_module, group)
    return train_module, None


def build_trainer(
    cfg: Config,
    spec: RunSpec,
    models: PPOModels,
    prompts: list[Prompt],
    *,
    prompt_rows: list[dict] | None = None,
    generator: Generator | None = None,
    ptx_batches: Callable[[], dict[str, torch.Tensor]] | None = None,
    group: torch.distributed.ProcessGroup | None = None,
    rank: int = 0,
) -> Trainer:
    """The trainer and everything it steps with: the update's module (sharded or wrapped first), the
    rollout engine (``generator`` replaces the configured one), this rank's prompt stream (with each prompt's
    whole row in ``prompt_rows``, for an environment), the optimizer
    and its schedule, the KL controller and the reward with its preprocessing."""
    # Dropout stays off for the whole run (as in TRL): the stored log-probs and values and the
    # update's first forward then agree exactly, so the first ratio is 1. Gradients still flow.
    for model in models.trained:
        model.eval()
    generator = generator or build_generator(
        cfg, spec, models
    )  # before sharding: a snapshot copies whole weights
    train_module, comm_counter = build_update_module(spec, models, group)
    prompt_stream = PromptStream(
        prompts,
        cfg.rollout.batch_size,
        samples_per_prompt=cfg.rollout.samples_per_prompt,
        shuffle=cfg.data.shuffle,
        seed=cfg.run.seed,
        rank=rank,
        world_size=spec.world_size,
        rows=prompt_rows,
    )
    optimizer = build_optimizer(cfg.ppo, models)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(cfg.ppo.lr_schedule, cfg.ppo.warmup_steps, cfg.run.steps)
    )
    reward = (  # a bare reward function (tests, the API) gets the config's one-source preprocessing
        models.reward
        if isinstance(models.reward, CombinedReward)
        else CombinedReward([ScoredComponent("reward", models.reward, transform=score_transform(cfg.reward))])
    )
    parts = TrainerParts(
        models,
        train_module,
        generator,
        prompt_stream,
        reward,
        optimizer,
        scheduler,
        build_kl_controller(cfg.kl),
        comm_counter,
        ptx_batches,
    )
    if spec.compile:  # after the snapshot engine copied the policy: its decode loop stays eager
        compile_layers(models.policy, models.value, models.reference)
    trainer_class = BestOfNTrainer if spec.algorithm == "best_of_n" else PPOTrainer  # its step differs
    return trainer_class(cfg, spec, parts, group=group, rank=rank)
