"""Every decision a config implies, made once, before anything heavy is loaded: :func:`resolve` turns a
config into a :class:`RunSpec`: the device, the precision, the strategy and what it shards, and one
:class:`RoleSpec` per model (where its weights come from and in which dtype, what of it is trained, what
it shares with whom, how many ranks hold a part of it). ``lmppo plan``, the builders, the trainer, the
pre-flight and both evaluations read the spec and decide none of these themselves. Every check that needs
more than one section (the estimator against the sampling, truncation against the reward's penalty, world
size, strategy, checkpoints, engine, critic source, 16-bit trained weights) runs here; the config's sections
check only their own keys.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from lmppo.errors import LmppoError
from lmppo.inputs.config import Config, LoraConfig, ModelSource, RewardConfig
from lmppo.inputs.config.reward import NO_SINGLE_SOURCE
from lmppo.math.estimators import ESTIMATORS, EstimatorSpec
from lmppo.user_code import load_function

Trained = Literal["all", "lora", "head", "none"]  # what of a model the optimizer steps


@dataclass(frozen=True)
class RoleSpec:
    """One model of a run as the config decides it.

    ``source`` is where its own weights come from, with the dtype settled; it is None for a reward
    function and for a model made of another's weights: the reference as the policy's adapter-disabled
    view or a frozen copy of its starting weights (``shares`` / ``copy_of`` name it), a critic on the
    policy's trunk. ``dtype`` is the frozen weights' dtype (trained weights are fp32 masters).
    """

    role: str  # "policy", "reference", "reward" or "reward <component>", "value"
    source: ModelSource | None
    dtype: str  # "-" for a function
    trained: Trained = "none"
    lora: LoraConfig | None = None
    shares: str | None = None  # the role whose weights this one runs on (LoRA reference, shared critic)
    copy_of: str | None = None  # the role whose starting weights this one copies, cast to ``dtype``
    init_from: str | None = None  # a separate critic's backbone: "policy" or "reward"
    saved: str | None = None  # a critic an earlier run saved, which this one starts from (its directory)
    shards: int = 1  # ranks FSDP2 splits its weights (and gradients, Adam moments) over

    @property
    def quantize(self) -> str | None:
        """``int8`` / ``nf4`` when its own linear weights are stored quantized (lmppo.modeling.quantize)."""
        return self.source.quantize if self.source is not None else None

    @property
    def offload(self) -> str:
        return self.source.offload if self.source is not None else "none"

    @property
    def note(self) -> str:
        """How it is made, in a few words (the plan's table)."""
        lora = f"LoRA r{self.lora.r}" if self.lora else ""
        if self.source is None and self.dtype == "-":
            return "function or URL"
        if self.shares and self.role != "value":
            return f"= {self.shares} base"
        if self.copy_of:
            return "a copy"
        made = f"from {self.saved}" if self.saved else f"from {self.init_from}" if self.init_from else ""
        if self.shares:
            return ", ".join(filter(None, ["shared trunk", made]))
        offloaded = f"offloaded: {self.offload}" if self.offload != "none" else ""
        return ", ".join(filter(None, [lora, made, offloaded]))


@dataclass(frozen=True)
class EngineSpec:
    """The rollout engine as the config decides it (``RunSpec.engine``)."""

    kind: Literal["hf", "vllm"]  # rollout.engine: the transformers decode loop or vLLM
    asynchronous: bool  # rollout.asynchronous: the next batch samples during this step's update
    owns_weights: bool  # samples from its own copy of the policy, synced after each update
    sleeps: bool  # vLLM frees its GPU memory during the update (never while it samples during it)
    weight_sync: str  # rollout.vllm_weight_sync: "merged" or "lora"
    values_from_decode: bool  # a shared-trunk critic's values read off the decode loop's hidden states
    bootstrap_values: bool  # the decode loop also values the state after a truncated row's last token
    environment: str | None  # what plays episodes of several turns (episode_environment); None: one response
    max_episode_tokens: int  # the tokens after the prompt a rollout row may hold (all of an episode's turns)


@dataclass(frozen=True)
class RunSpec:
    """The resolved run: read by the plan, the builders, the trainer, the pre-flight and evaluation."""

    device: torch.device
    precision: str  # "bf16" or "fp32": the forward passes' numerics
    precision_reason: str  # why: set in the config, or what run.precision=auto found on this device
    fp32_matmul_precision: str  # run.fp32_matmul_precision, torch's name for how fp32 matmuls compute
    world_size: int
    strategy: str  # "ddp" or "fsdp2" (one process: "ddp", nothing to sync)
    sharded: bool  # FSDP2 over several ranks: the models are split, every pass outside the update gathers
    sharded_checkpoints: bool  # each rank writes its own shards
    engine: EngineSpec
    policy: RoleSpec
    reference: RoleSpec
    rewards: tuple[RoleSpec, ...]  # one per reward component, in the config's order
    value: RoleSpec | None  # None: a critic-free estimator or best-of-n, no value model
    algorithm: str  # run.algorithm: "ppo" or "best_of_n"
    estimator: EstimatorSpec
    compile: bool  # run.compile: the update's forward and the stored passes through torch.compile

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype forward passes compute in (None: the weights' own)."""
        return torch.bfloat16 if self.precision == "bf16" else None

    @property
    def roles(self) -> list[RoleSpec]:
        return [self.policy, self.reference, *self.rewards, *([self.value] if self.value else [])]


def resolve(
    cfg: Config, *, device: torch.device | str | None = None, world_size: int = 1, present: bool = True
) -> RunSpec:
    """The run ``cfg`` describes on ``world_size`` ranks of ``device`` (default: ``run.device``).
    ``present=False`` for a plan, which may be made for a CUDA device this machine does not have."""
    check_sections(cfg)
    device = torch.device(device) if device is not None else resolve_device(cfg.run.device, present=present)
    precision, precision_reason = resolve_precision(cfg.run.precision, device)
    check_distributed(cfg, world_size)
    check_engine(cfg)
    check_compiler(cfg, device)
    if cfg.run.algorithm == "best_of_n" and world_size > 1:
        raise LmppoError(
            "best-of-n runs in one process (each rank would keep another number of winners, and its SFT "
            "steps must match across ranks); start it without torchrun"
        )
    strategy = cfg.distributed.strategy
    sharded = strategy == "fsdp2" and world_size > 1
    trained_shards = world_size if sharded else 1
    frozen_shards = world_size if sharded and cfg.distributed.shard_frozen else 1
    policy = policy_role(cfg, precision, trained_shards)
    rewards = reward_roles(cfg.reward, precision, frozen_shards)
    estimator = resolve_estimator(cfg)
    check_memory_rungs(cfg, device, trained_shards, frozen_shards)
    return RunSpec(
        device=device,
        precision=precision,
        precision_reason=precision_reason,
        fp32_matmul_precision=cfg.run.fp32_matmul_precision,
        world_size=world_size,
        strategy=strategy,
        sharded=sharded,
        sharded_checkpoints=sharded and cfg.distributed.checkpoint == "sharded",
        engine=resolve_engine(cfg, estimator, device, sharded),
        policy=policy,
        reference=reference_role(cfg, precision, policy, frozen_shards),
        rewards=rewards,
        value=value_role(cfg, policy, rewards, trained_shards) if estimator.critic else None,
        algorithm=cfg.run.algorithm,
        estimator=estimator,
        compile=cfg.run.compile,
    )


def resolve_estimator(cfg: Config) -> EstimatorSpec:
    """``ppo.advantage``'s row of :data:`lmppo.math.estimators.ESTIMATORS`, settled with the settings that
    shape it: best-of-n trains no critic; whitening only where the row allows it (a group baseline is already
    on its group's scale, and Dr. GRPO drops exactly that division); GAE's two lambdas (``ppo.lam`` where
    ``ppo.lam_policy`` or ``ppo.lam_critic`` is not set)."""
    row, ppo = ESTIMATORS[cfg.ppo.advantage], cfg.ppo
    return EstimatorSpec(
        name=ppo.advantage,
        critic=row.critic and cfg.run.algorithm == "ppo",
        group_baseline=row.group_baseline,
        group_size=cfg.rollout.samples_per_prompt,
        whiten=row.whitens and ppo.whiten_advantages,
        kl_in_loss=cfg.kl.in_loss,
        bootstrap_truncated=cfg.rollout.truncation == "bootstrap",
        lam_policy=_lam(ppo.lam_policy, ppo.lam),
        lam_critic=_lam(ppo.lam_critic, ppo.lam),
        lam_alpha=ppo.lam_alpha,
        gamma=ppo.gamma,
        kl_estimator=cfg.kl.estimator,
    )


def _lam(lam: float | str | None, default: float) -> float | None:
    """A decoupled lambda: the config's, else ``ppo.lam``; None for the length-adaptive one."""
    return default if lam is None else None if lam == "length_adaptive" else lam


def resolve_engine(cfg: Config, estimator: EstimatorSpec, device: torch.device, sharded: bool) -> EngineSpec:
    """``rollout.engine`` and how it meets the trainer: vLLM, and the decode loop under
    ``rollout.asynchronous`` (on a snapshot), sample from their own copy of the policy; only the
    synchronous decode loop on the trained module can read a shared-trunk critic's values as it samples
    (under FSDP2 the head is sharded with the trunk, so the trainer's gathered values pass stays)."""
    r = cfg.rollout
    vllm, shared_critic = r.engine == "vllm", estimator.critic and cfg.models.value.mode == "shared"
    environment = episode_environment(cfg)
    episodes = environment is not None
    return EngineSpec(
        kind=r.engine,
        asynchronous=r.asynchronous,
        owns_weights=vllm or r.asynchronous,
        # vLLM's sleep mode frees GPU memory; an engine sampling during the update must stay awake, and one
        # playing episodes keeps its cache between turns
        sleeps=vllm and not r.asynchronous and device.type == "cuda" and not episodes,
        weight_sync=r.vllm_weight_sync,
        # an episode's turns are sampled one by one: its values come from the stored pass over all of it
        values_from_decode=shared_critic and not sharded and not vllm and not r.asynchronous and not episodes,
        bootstrap_values=estimator.bootstrap_truncated,  # terminal: the estimator zeroes it anyway
        environment=environment,
        max_episode_tokens=episode_token_limit(cfg),
    )


# --------------------------------------------------------------------------------------------------
# Device, precision, dtypes
# --------------------------------------------------------------------------------------------------


def resolve_device(name: str, *, present: bool = True) -> torch.device:
    """``run.device``: auto picks CUDA when a device is visible. ``present=False`` for a plan, which may be
    made for a CUDA device this machine does not have."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and present and not torch.cuda.is_available():
        raise LmppoError("run.device=cuda but no CUDA device is visible; use run.device=cpu or auto")
    return torch.device(name)


def resolve_precision(precision: str, device: torch.device) -> tuple[str, str]:
    """``run.precision`` for this device, and why: ``auto`` is bf16 on a CUDA device with bf16 support
    (assumed for one that is planned for but not present) and on a CPU with AMX, whose bf16 matrix
    products run several times fp32's; fp32 elsewhere."""
    if precision != "auto":
        return precision, "set by run.precision"
    if device.type == "cuda":
        if not torch.cuda.is_available() or torch.cuda.is_bf16_supported():
            return "bf16", "run.precision=auto on a CUDA device with bf16"
        return "fp32", "run.precision=auto on a CUDA device without bf16"
    matmuls = cpu_bf16_matmuls()
    if matmuls == "amx":
        return "bf16", "run.precision=auto on a CPU with AMX (bf16 matrix products 4-7x fp32's)"
    if matmuls == "avx512_bf16":
        return "fp32", (
            "run.precision=auto on a CPU without AMX; it has AVX512-BF16, where run.precision=bf16 "
            "measured 1.2x faster on SmolLM2's PPO step (docs/performance.md)"
        )
    return "fp32", "run.precision=auto on a CPU without bf16 matrix instructions"


def cpu_bf16_matmuls() -> str | None:
    """This CPU's bf16 matrix instructions: "amx" (Intel Xeon 4th gen and later), "avx512_bf16", or None."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no flags to read, fp32 is the safe choice
        return None
    flags = {flag for line in info.splitlines() if line.startswith("flags") for flag in line.split()}
    if "amx_bf16" in flags:
        return "amx"
    return "avx512_bf16" if "avx512_bf16" in flags else None


def settled_dtype(section: ModelSource, where: str, *, precision: str, trained: bool) -> ModelSource:
    """``section`` with its weights' dtype decided: unset means bfloat16 for frozen weights under bf16
    and float32 otherwise. Trained weights are fp32 masters (bf16 Adam updates round away small steps),
    so an explicit 16-bit dtype on fully trained weights is refused."""
    if section.dtype is None:
        dtype = "bfloat16" if precision == "bf16" and not trained else "float32"
        return section.model_copy(update={"dtype": dtype})
    if trained and section.dtype != "float32":
        raise LmppoError(
            f"{where}.dtype={section.dtype} would train every weight in 16 bits, with no fp32 master copy "
            f"for Adam's small updates; remove {where}.dtype (run.precision=bf16 computes in bf16 and keeps "
            "fp32 weights), or train LoRA adapters on the 16-bit base (models.policy_lora.enabled=true)"
        )
    return section


# --------------------------------------------------------------------------------------------------
# The four roles
# --------------------------------------------------------------------------------------------------


def policy_role(cfg: Config, precision: str, shards: int = 1) -> RoleSpec:
    """The policy: all of it trained in fp32, or LoRA adapters on a base in the frozen dtype."""
    lora = cfg.models.policy_lora
    source = settled_dtype(cfg.models.policy, "models.policy", precision=precision, trained=not lora.enabled)
    trained = "lora" if lora.enabled else "all"
    return RoleSpec("policy", source, source.dtype, trained, lora if lora.enabled else None, shards=shards)


def frozen_policy_source(cfg: Config, spec: RunSpec) -> ModelSource:
    """``models.policy`` to load for evaluation only: frozen, so in the frozen dtype of the run's precision,
    and unquantized (a QLoRA run's ``final/`` is its base's own weights plus the adapters' update, and the
    start it is compared with is that base as the user gave it)."""
    source = settled_dtype(cfg.models.policy, "models.policy", precision=spec.precision, trained=False)
    return source.model_copy(update={"quantize": None})


def reference_role(cfg: Config, precision: str, policy: RoleSpec, shards: int = 1) -> RoleSpec:
    """Its own frozen model; else the policy's starting weights: the adapter-disabled policy under LoRA (no
    weights of its own), or a frozen copy (2 bytes per weight under bf16)."""
    if cfg.models.reference is not None:
        source = settled_dtype(cfg.models.reference, "models.reference", precision=precision, trained=False)
        return RoleSpec("reference", source, source.dtype, shards=shards)
    if policy.lora is not None:
        return RoleSpec("reference", None, policy.dtype, shares="policy")
    return RoleSpec(
        "reference", None, "bfloat16" if precision == "bf16" else "float32", copy_of="policy", shards=shards
    )


def reward_roles(reward: RewardConfig, precision: str, shards: int = 1) -> tuple[RoleSpec, ...]:
    """One frozen reward model (in the frozen dtype) or function per reward component."""
    named = bool(reward.components)
    roles = []
    for i, component in enumerate(reward.sources()):
        role = f"reward {component.name}" if named else "reward"
        if component.model is None:
            roles.append(RoleSpec(role, None, "-"))
            continue
        where = f"reward.components[{i}].model" if named else "reward.model"
        source = settled_dtype(component.model, where, precision=precision, trained=False)
        roles.append(RoleSpec(role, source, source.dtype, shards=shards))
    return tuple(roles)


def value_role(cfg: Config, policy: RoleSpec, rewards: tuple[RoleSpec, ...], shards: int = 1) -> RoleSpec:
    """The critic: an fp32 head on the policy's trunk (sharded with it), or a separate network from the
    policy or the first reward model, all of it trained in fp32 or LoRA on a base in that model's dtype."""
    v, saved = cfg.models.value, saved_critic(cfg)
    if v.mode == "shared":
        return RoleSpec("value", None, "float32", "head", shares="policy", saved=saved, shards=shards)
    if saved:  # its backbone is the saved one, whatever init_from says
        base = policy
    elif v.init_from == "reward":
        learned = [r for r in rewards if r.source is not None]
        if not learned:
            raise LmppoError(
                "models.value.init_from=reward needs a reward model (reward.model, or a learned reward "
                "component); with a programmatic reward use models.value.init_from=policy"
            )
        base = learned[0]
    else:
        base = policy
    if not saved and base.quantize:
        raise LmppoError(
            f"models.value.init_from={v.init_from} copies a quantized model into the trained critic; use "
            "models.value.mode=shared (a head on the policy's trunk), init the critic from the other model, "
            "or a critic-free ppo.advantage"
        )
    lora = v.lora if v.lora.enabled else None
    dtype = base.dtype if lora else "float32"  # what is trained is fp32, also when copied from 16 bits
    return RoleSpec(
        "value",
        None,
        dtype,
        "lora" if lora else "all",
        lora,
        init_from=None if saved else v.init_from,
        saved=saved,
        shards=shards,
    )


CRITIC_RECORD = "value.json"  # marks a directory as a critic lmppo saved (lmppo.modeling.models.save_critic)


def saved_critic(cfg: Config) -> str | None:
    """The saved critic a run starts from: ``models.value.path``, else the policy directory's ``value/``
    when it holds a critic of this run's mode (a policy lmppo exported brings its critic along)."""
    v = cfg.models.value
    if v.path is None:
        beside = Path(cfg.models.policy.path) / "value"
        return str(beside) if saved_critic_mode(beside) == v.mode else None
    mode = saved_critic_mode(Path(v.path))
    if mode is None:
        raise LmppoError(
            f"models.value.path={v.path}: there is no critic saved by lmppo there ({CRITIC_RECORD} is "
            "missing). Give the value/ directory a run wrote beside its policy (RUN/final/value or "
            "RUN/best/value), or leave models.value.path out to start a new critic."
        )
    if mode != v.mode:
        raise LmppoError(
            f"models.value.path={v.path} holds a {mode} critic, and this run's is models.value.mode={v.mode}; "
            f"set models.value.mode={mode} to start from it, or leave models.value.path out to start a new critic."
        )
    return v.path


def saved_critic_mode(path: Path) -> str | None:
    """``shared`` or ``separate`` for a critic lmppo saved at ``path``, else None."""
    try:
        return json.loads((path / CRITIC_RECORD).read_text()).get("mode")
    except (OSError, ValueError, AttributeError):
        return None


# --------------------------------------------------------------------------------------------------
# Checks across sections
# --------------------------------------------------------------------------------------------------


def check_sections(cfg: Config) -> None:
    """The checks across sections that read the config alone (no device, ranks or files): :func:`resolve`
    makes them first, and the quickstart before its first stage trains."""
    check_reward_source(cfg)
    check_missing_eos_penalty(cfg)
    check_sharded_checkpoints(cfg)
    check_weight_sync(cfg)
    check_estimator(cfg)


def check_reward_source(cfg: Config) -> None:
    """A run needs a reward: a reward source, or an environment (or tools) whose turn rewards are all of it."""
    if not cfg.reward.configured and not (cfg.rollout.environment or cfg.rollout.tools):
        raise LmppoError(
            f"the run has no reward: {NO_SINGLE_SOURCE}; or set rollout.environment (or rollout.tools) when "
            "the environment's turn rewards are the whole reward"
        )


def check_missing_eos_penalty(cfg: Config) -> None:
    """A penalty on truncated rows' scores needs truncated rows to be scored."""
    penalised = [c for c in cfg.reward.sources() if c.missing_eos_penalty is not None]
    if penalised and cfg.rollout.truncation == "bootstrap":
        key = "reward" if not cfg.reward.components else f"reward component {penalised[0].name!r}"
        raise LmppoError(
            f"{key}'s missing_eos_penalty penalises truncated rows' scores, but rollout.truncation=bootstrap "
            "gives truncated rows no score: set rollout.truncation=terminal or remove the penalty"
        )


def check_sharded_checkpoints(cfg: Config) -> None:
    """Each rank writes its own shards only where FSDP2 made some."""
    if cfg.distributed.checkpoint == "sharded" and cfg.distributed.strategy != "fsdp2":
        raise LmppoError(
            "distributed.checkpoint=sharded writes each rank's FSDP2 shards, and distributed.strategy="
            f"{cfg.distributed.strategy} has none; set distributed.strategy=fsdp2 or distributed.checkpoint=full"
        )


def check_weight_sync(cfg: Config) -> None:
    """vLLM can be sent the policy's LoRA adapters alone only when it has some."""
    if cfg.rollout.vllm_weight_sync == "lora" and not cfg.models.policy_lora.enabled:
        raise LmppoError(
            "rollout.vllm_weight_sync=lora pushes the policy's LoRA adapters, and models.policy_lora is off: "
            "set models.policy_lora.enabled=true or rollout.vllm_weight_sync=merged"
        )


def check_estimator(cfg: Config) -> None:
    """``ppo.advantage`` and best-of-n against the sampling: a group baseline, and best-of-n's choice, need
    several samples per prompt; a critic-free estimator takes no setting of a critic."""
    advantage, n = cfg.ppo.advantage, cfg.rollout.samples_per_prompt
    estimator = ESTIMATORS[advantage]
    if cfg.run.algorithm == "best_of_n" and n < 2:
        raise LmppoError(
            f"best-of-n keeps the best of rollout.samples_per_prompt responses per prompt, and it is {n}; "
            "set rollout.samples_per_prompt to K >= 2 (4 or 8 is usual)"
        )
    if estimator.groups and n < 2:
        raise LmppoError(
            f"ppo.advantage={advantage} compares the samples of one prompt, and rollout.samples_per_prompt"
            f"={n} draws one; set rollout.samples_per_prompt to 2 or more (4-16 is usual)"
        )
    if not estimator.critic:
        check_critic_free(cfg)


def check_critic_free(cfg: Config) -> None:
    """A critic-free ``ppo.advantage`` with no setting that needs a critic's values."""
    advantage = cfg.ppo.advantage
    if cfg.rollout.truncation == "bootstrap":
        raise LmppoError(
            f"rollout.truncation=bootstrap values a truncated row by the critic, and ppo.advantage="
            f"{advantage} has none; set rollout.truncation=terminal or ppo.advantage=gae"
        )
    if cfg.ppo.critic_warmup_steps:
        raise LmppoError(
            f"ppo.critic_warmup_steps trains the critic alone, and ppo.advantage={advantage} has none; "
            "remove it or set ppo.advantage=gae"
        )
    lams = [k for k in ("lam_policy", "lam_critic") if getattr(cfg.ppo, k) is not None]
    if lams:
        raise LmppoError(
            f"ppo.{lams[0]} is a lambda of GAE over the critic's values, and ppo.advantage={advantage} "
            "has no critic (its return is the reward-to-go); remove it or set ppo.advantage=gae"
        )


def check_distributed(cfg: Config, world_size: int) -> None:
    """FSDP2 needs ranks to shard over, and every global batch size splits evenly over the ranks."""
    if cfg.distributed.strategy == "fsdp2" and world_size == 1:
        raise LmppoError(
            "distributed.strategy=fsdp2 shards the models over the ranks torchrun starts, and this is one "
            "process; start it with `torchrun --nproc-per-node N -m lmppo ppo ...` (plan it with `lmppo plan "
            "CONFIG --ranks N`), or set distributed.strategy=ddp"
        )
    global_sizes = {
        "rollout.batch_size": cfg.rollout.batch_size,
        "ppo.minibatch_size": cfg.ppo.minibatch_size,
        "ppo.micro_batch_size": cfg.ppo.micro_batch_size,
    }
    for name, size in global_sizes.items():
        if size is not None and size % world_size:
            raise LmppoError(
                f"{name}={size} is a global size and must be divisible by the {world_size} ranks; "
                f"set it to a multiple of {world_size} or change --nproc-per-node"
            )


def check_batches(cfg: Config, prompt_count: int) -> None:
    """A step's prompts within the prompt set, a minibatch within a step's responses: every problem in
    one error, with sizes that fix all of them at once."""
    r, minibatch = cfg.rollout, cfg.ppo.minibatch_size
    problems = []
    if r.batch_size > prompt_count:
        problems.append(
            f"rollout.batch_size={r.batch_size} is larger than the {prompt_count} prompts of data.prompts"
        )
    if minibatch > r.responses_per_step:
        problems.append(
            f"ppo.minibatch_size={minibatch} is larger than the {r.responses_per_step} responses of a step "
            f"(rollout.batch_size={r.batch_size} x rollout.samples_per_prompt={r.samples_per_prompt})"
        )
    if problems:
        batch, minibatch = fitted_batches(cfg, prompt_count)
        raise LmppoError(
            f"{'; and '.join(problems)}: set rollout.batch_size={batch} ppo.minibatch_size={minibatch}, or give "
            "more prompts"
        )


def fitted_batches(cfg: Config, prompt_count: int) -> tuple[int, int]:
    """``(rollout.batch_size, ppo.minibatch_size)``: the config's, shrunk to ``prompt_count`` prompts and
    to what a step samples (at least two minibatches when the minibatch had to shrink)."""
    batch = min(cfg.rollout.batch_size, prompt_count)
    responses = batch * cfg.rollout.samples_per_prompt
    minibatch = cfg.ppo.minibatch_size
    if minibatch > responses:
        minibatch = max(responses // 2, 1)
    return batch, minibatch


def frozen_sections(cfg: Config) -> list[tuple[str, ModelSource]]:
    """The frozen models' own sections, by config key: the reference and each reward model."""
    sections = [("models.reference", cfg.models.reference)]
    named = bool(cfg.reward.components)
    for i, source in enumerate(cfg.reward.sources()):
        sections.append((f"reward.components.{i}.model" if named else "reward.model", source.model))
    return [(key, section) for key, section in sections if section is not None]


def check_memory_rungs(cfg: Config, device: torch.device, trained_shards: int, frozen_shards: int):
    """Quantized and offloaded models where they can be: quantized weights are frozen and whole (no FSDP2
    shards, no vLLM copy; :func:`value_role` refuses a critic copied from them); offloading is for a CUDA
    device."""
    policy = cfg.models.policy
    if policy.quantize and not cfg.models.policy_lora.enabled:
        raise LmppoError(
            f"models.policy.quantize={policy.quantize} would train quantized weights; quantize the base of a "
            "LoRA policy (QLoRA: models.policy_lora.enabled=true), or remove the key"
        )
    if policy.offload != "none":
        raise LmppoError(
            "models.policy.offload: the policy is trained, so its weights stay on the device; offload the "
            "frozen models instead (models.reference.offload, reward.model.offload), or shrink what is trained "
            "(models.policy_lora.enabled=true)"
        )
    quantized = [(k, s) for k, s in [("models.policy", policy), *frozen_sections(cfg)] if s.quantize]
    for key, section in quantized:
        require_torchao(f"{key}.quantize")
        shards = trained_shards if key == "models.policy" else frozen_shards
        if shards > 1:
            raise LmppoError(
                f"{key}.quantize={section.quantize}: FSDP2 does not shard quantized weights here; keep the "
                "frozen models whole on each rank (distributed.shard_frozen=false) and the QLoRA policy under "
                "distributed.strategy=ddp, or remove the key"
            )
    if policy.quantize and (cfg.rollout.engine == "vllm" or cfg.rollout.asynchronous):
        raise LmppoError(
            "models.policy.quantize: an engine with its own copy of the policy (rollout.engine=vllm or "
            "rollout.asynchronous) receives the policy's weights every step and takes no quantized ones from "
            "lmppo; use synchronous rollouts on rollout.engine=hf with a quantized policy base"
        )
    offloaded = [f"{key}.offload" for key, s in frozen_sections(cfg) if s.offload != "none"]
    if offloaded and device.type != "cuda":
        raise LmppoError(
            f"{', '.join(offloaded)}: offloading moves a frozen model's weights from a GPU's memory to host "
            f"memory, and this run is on {device.type}, where they are in host memory already; remove the key"
        )
    if offloaded and max(trained_shards, frozen_shards) > 1:
        raise LmppoError(
            f"{', '.join(offloaded)}: under FSDP2 the models are split over the ranks instead; offload in "
            "a DDP or single-process run, or remove the key"
        )


def check_engine(cfg: Config) -> None:
    """vLLM loads the policy from a transformers directory; best-of-n samples synchronously."""
    if cfg.rollout.asynchronous and cfg.run.algorithm == "best_of_n":
        raise LmppoError(
            "rollout.asynchronous overlaps sampling with a PPO update; best-of-n fine-tunes on each round's "
            "winners before sampling again, so it has nothing to overlap; remove the key"
        )
    if episode_environment(cfg) is not None:
        check_episodes(cfg)
    limit = episode_token_limit(cfg)
    if cfg.reward.overlong_buffer is not None and cfg.reward.overlong_buffer > limit:
        raise LmppoError(
            f"reward.overlong_buffer={cfg.reward.overlong_buffer} tokens is longer than the {limit} a response "
            "may have (rollout.max_new_tokens, or an episode's max_total_tokens); give it at most that"
        )
    if cfg.rollout.engine != "vllm":
        return
    if cfg.models.policy.gguf_file or not Path(cfg.models.policy.path).is_dir():
        raise LmppoError(
            "rollout.engine=vllm loads models.policy.path as a transformers directory; convert a "
            "GGUF file first (lmppo.modeling.loading.cache_gguf_as_transformers)"
        )


TOOL_ENVIRONMENT = "lmppo.sampling.environments:ToolEnvironment"  # what answers rollout.tools alone
MCP_PREFIXES = ("mcp:", "http://", "https://")  # a rollout.tools spec naming an MCP server


def episode_environment(cfg: Config) -> str | None:
    """The environment class that plays a run's episodes: ``rollout.environment``, else a ToolEnvironment
    answering ``rollout.tools``; None: one response per prompt."""
    return cfg.rollout.environment or (TOOL_ENVIRONMENT if cfg.rollout.tools else None)


def episode_token_limit(cfg: Config) -> int:
    """The tokens after the prompt a rollout row may hold: a response's, or all of an episode's turns."""
    r = cfg.rollout
    if episode_environment(cfg) is None:
        return r.max_new_tokens
    return r.max_total_tokens or r.max_turns * r.max_new_tokens


def check_episodes(cfg: Config) -> None:
    """What episodes (``rollout.environment``, ``rollout.tools``) run with: an environment and tool functions
    that import (before any model loads; a module is imported once per process), chat prompts (an
    environment's messages go through the chat template), and room for a turn in the episode's budget."""
    if cfg.rollout.environment is not None:
        check_environment_source(cfg.rollout.environment)
    check_tools(cfg)
    if cfg.data.raw_prompts:
        key = "rollout.environment" if cfg.rollout.environment is not None else "rollout.tools"
        raise LmppoError(
            f"{key} plays episodes on chat prompts (an environment's messages go through the chat template; "
            "docs/multiturn.md); data.raw_prompts cannot run with it: remove one of the two"
        )
    if cfg.rollout.max_total_tokens is not None and cfg.rollout.max_total_tokens < cfg.rollout.max_new_tokens:
        raise LmppoError(
            f"rollout.max_total_tokens={cfg.rollout.max_total_tokens} is below rollout.max_new_tokens="
            f"{cfg.rollout.max_new_tokens}, so not even one turn fits; raise it or leave it unset"
        )


# rollout.environment specs served by an ecosystem package: prefix -> (its module, the lmppo extra)
ENVIRONMENT_PACKAGES = {"openenv:": ("openenv", "openenv"), "textarena:": ("textarena", "textarena")}


def check_environment_source(spec: str) -> None:
    """``rollout.environment`` before any model loads: a user's class imports; a package's environment
    (``openenv:URL``, ``textarena:GAME``) has its package installed (the environment itself is made when the
    run builds its generator)."""
    for prefix, (module, extra) in ENVIRONMENT_PACKAGES.items():
        if spec.startswith(prefix):
            if importlib.util.find_spec(module) is None:
                raise LmppoError(
                    f"rollout.environment {spec!r} needs the {module} package, which is not installed: "
                    f"`pip install 'lmppo[{extra}]'`, or name another environment"
                )
            return
    load_function(spec, "rollout.environment", kind="Class")


def check_tools(cfg: Config) -> None:
    """``rollout.tools``' Python functions load and make schemas with distinct names; MCP servers are checked
    when the toolbox starts (before step 1), an environment's own tools when it is built."""
    functions = [spec for spec in cfg.rollout.tools if not spec.startswith(MCP_PREFIXES)]
    names: dict[str, str] = {}
    for spec in functions:
        name = tool_function(spec).schema["function"]["name"]
        if name in names:
            raise LmppoError(
                f"rollout.tools: two tools are named {name!r}, from {names[name]!r} and {spec!r}; a call names "
                "its tool, so names must differ: rename one or remove a spec"
            )
        names[name] = spec


@dataclass(frozen=True)
class ToolFunction:
    """A ``rollout.tools`` Python function and its JSON schema (what the chat template renders)."""

    function: Callable[..., Any]
    schema: dict


def tool_function(spec: str) -> ToolFunction:
    """The function ``spec`` names with the schema ``transformers.utils.get_json_schema`` makes of its type
    hints and Google-style docstring; an error naming the spec and what to add when it cannot."""
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    function = load_function(spec, "rollout.tools")
    try:
        return ToolFunction(function, get_json_schema(function))
    except (DocstringParsingException, TypeHintParsingException) as err:
        raise LmppoError(
            f"rollout.tools {spec!r}: its JSON schema cannot be made ({err}). A tool function needs a type "
            "hint on every argument and a Google-style docstring: a summary line, then an 'Args:' section "
            "with one 'name: description' line per argument (docs/multiturn.md)."
        ) from None


def check_compiler(cfg: Config, device: torch.device) -> None:
    """``run.compile`` on a CPU builds C++ kernels: refuse it before the first step when none of the
    compilers inductor looks for is on PATH (it would fail inside the step, in a traceback)."""
    if not cfg.run.compile or device.type != "cpu":
        return
    from torch._inductor import config as inductor  # noqa: PLC0415  (its own search list: $CXX or g++)

    searched = [cxx for cxx in inductor.cpp.cxx if cxx]
    if any(shutil.which(cxx) for cxx in searched):
        return
    raise LmppoError(
        f"run.compile on a CPU builds C++ kernels, and no C++ compiler is on PATH (inductor looks for "
        f"{' or '.join(searched)}; $CXX names another): install one (`apt install g++`, "
        "`xcode-select --install`) or set run.compile=false"
    )


def require_torchao(what: str) -> None:
    """Refuse ``what`` (a config key) when torchao is not installed, naming the install."""
    if importlib.util.find_spec("torchao") is None:
        raise LmppoError(
            f"{what} quantizes with torchao, which is not installed: `pip install 'lmppo[quantize]'` "
            "(or `pip install torchao`), or remove the key"
        )
