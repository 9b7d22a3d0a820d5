"""What a run leaves: the trained policy as a plain transformers directory with its model card (``final/``,
and ``best/`` from the best held-out step's checkpoint), each with the trained critic in ``value/`` for a
later run to start from (``models.value.path``; a run on that policy finds it by itself)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from peft import PeftModel
from torch import nn
from transformers import GenerationConfig

from lmppo.errors import LmppoError
from lmppo.inputs.config import Config
from lmppo.inputs.resolve import RunSpec, policy_role
from lmppo.modeling.distributed import full_tensor, whole_group
from lmppo.modeling.loading import load_reward_model
from lmppo.modeling.models import PPOModels, ValueModel, make_value_model, save_critic
from lmppo.runs.build import load_policy
from lmppo.runs.checkpoint import Checkpoint, best_checkpoint, load_checkpoint


def plain_policy(spec: RunSpec, weights: dict[str, torch.Tensor], source: str) -> nn.Module:
    """The starting policy built afresh on the CPU with ``weights`` (all of them, or the trained ones)
    loaded over it; ``source`` names where they come from in an error."""
    return loaded_over(load_policy(spec.policy), weights, f"{source} holds policy weights")


def loaded_over(module: nn.Module, weights: dict[str, torch.Tensor], holder: str) -> nn.Module:
    """``module`` with ``weights`` (all of its own, or the trained ones) loaded over it on the CPU; a weight
    it lacks is an error naming ``holder``."""
    unexpected = module.load_state_dict(
        {k: v.cpu() for k, v in weights.items()}, strict=False
    ).unexpected_keys
    if unexpected:
        raise LmppoError(f"{holder} this model does not have: {unexpected[:3]}")
    return module


def whole_policy(cfg: Config, spec: RunSpec, models: PPOModels, is_main: bool) -> nn.Module | None:
    """An FSDP2-sharded policy's weights gathered whole into a plain copy on rank 0's CPU (every rank
    takes part in the gathering; the others get None)."""
    state = {name: full_tensor(tensor) for name, tensor in models.policy.state_dict().items()}
    return plain_policy(spec, state, "the sharded policy") if is_main else None


def export_best(run_dir: Path, best: dict, cfg: Config, spec: RunSpec, tokenizer) -> Path:
    """``best/``: the policy (and critic) of the step with the best held-out score (``best``: its step,
    metric and score), from its checkpoint."""
    saved = load_checkpoint(best_checkpoint(run_dir))
    policy = plain_policy(spec, checkpoint_group(saved, "policy"), f"checkpoint {saved.path}")
    held_out = f"the best {best['metric']} on the held-out prompts ({best['score']:.4g})"
    out_dir = export_final(run_dir / "best", policy, tokenizer, cfg, spec, f"step {best['step']}: {held_out}")
    if spec.value is not None:
        export_critic(out_dir / "value", spec, saved)
    return out_dir


def checkpoint_group(saved: Checkpoint, name: str) -> dict[str, torch.Tensor]:
    """A checkpoint's group ``name`` whole (put together from a sharded checkpoint's per-rank files)."""
    return whole_group(saved.tensors, name, saved.state.get("sharded_ranks"))


def export_critic(out_dir: Path, spec: RunSpec, saved: Checkpoint) -> Path:
    """The critic of checkpoint ``saved`` as a directory a later run starts from (``models.value.path``):
    a shared critic's head, or a separate critic built afresh on the CPU with its trained weights."""
    weights = checkpoint_group(saved, "value")
    record = {"step": saved.state["step"], "checkpoint": str(saved.path)}
    if spec.value.shares:  # the trunk is the policy exported beside it: the head is all of its own
        return save_critic(out_dir, {k.removeprefix("head."): v for k, v in weights.items()}, None, record)
    critic = loaded_over(starting_critic(spec), weights, f"checkpoint {saved.path} holds critic weights")
    return save_critic(out_dir, critic.head.state_dict(), critic.backbone, record)


def starting_critic(spec: RunSpec) -> ValueModel:
    """A separate critic as the run started it, on the CPU: the base its trained weights load over."""
    role = spec.value
    policy = load_policy(spec.policy) if role.init_from == "policy" else None
    learned = next((r for r in spec.rewards if r.source is not None), None)
    reward_model = load_reward_model(learned.source) if role.init_from == "reward" else None
    return make_value_model(role, policy, reward_model)


def reward_summary(cfg: Config) -> str:
    """The reward as the model card states it: each source, its weight and its preprocessing."""
    parts = []
    for c in cfg.reward.sources():
        source = c.model.path if c.model else f"the server {c.url}" if c.url else f"the function {c.function}"
        weight = f"{c.name}: {c.weight:g} x " if cfg.reward.components else ""
        preprocessing = f"missing-EOS penalty {c.missing_eos_penalty}, clip {c.clip}, normalize {c.normalize}"
        parts.append(f"{weight}{source} (preprocessing: {preprocessing})")
    gate = cfg.reward.gate
    gated = f"; rows with {gate.component} below {gate.below:g} get {gate.component} alone" if gate else ""
    return " + ".join(parts) + gated


def dequantized(policy: PeftModel, cfg: Config) -> PeftModel:
    """A QLoRA policy's adapters on its base loaded again unquantized, so the saved model is the base's own
    weights plus the adapters' update (a quantized base would round that update away); any other policy
    as it is."""
    if not cfg.models.policy.quantize:
        return policy
    role = policy_role(cfg, "fp32")
    plain = load_policy(replace(role, source=role.source.model_copy(update={"quantize": None})))
    adapters = {name: p.detach().cpu() for name, p in policy.named_parameters() if p.requires_grad}
    plain.load_state_dict(adapters, strict=False)
    return plain


def export_final(
    out_dir: Path, policy: nn.Module, tokenizer, cfg: Config, spec: RunSpec, which: str = ""
) -> Path:
    """The trained policy as a plain transformers directory, with our decoding settings and a model card;
    ``which`` says which of the run's policies it is when not the last (``best/``)."""
    if isinstance(policy, PeftModel):
        policy = dequantized(policy, cfg).merge_and_unload()  # training is over: fold the adapter in
    policy.generation_config = GenerationConfig(
        do_sample=True,
        temperature=cfg.rollout.temperature,
        top_k=cfg.rollout.top_k,
        top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.rollout.max_new_tokens,
        eos_token_id=sorted({*cfg.rollout.stop_token_ids, tokenizer.eos_token_id} - {None}),
        pad_token_id=tokenizer.pad_token_id,
    )
    policy.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    reward = reward_summary(cfg)
    kl = (
        f"adaptive, target {cfg.kl.target} nats, horizon {cfg.kl.horizon}"
        if cfg.kl.adaptive
        else f"fixed beta = {cfg.kl.beta}"
    )
    which = (
        f"- This is the policy after {which}; the run's last policy (if it finished) is in `final/`\n"
        if which
        else ""
    )
    estimator = spec.estimator
    critic = (
        f"- Critic: in `value/` ({cfg.models.value.mode}); a run on this policy starts its critic from it "
        "(or set models.value.path)\n"
        if estimator.critic
        else ""
    )
    lam = estimator.lam_critic
    if estimator.lam_policy != estimator.lam_critic:  # decoupled (VC-PPO), or VAPO's length-adaptive one
        policy_lam = "length-adaptive" if estimator.lam_policy is None else estimator.lam_policy
        lam = f"{policy_lam} / {lam} (policy / critic)"
    (out_dir / "README.md").write_text(
        f"# PPO policy trained with lmppo\n\n"
        f"- Started from: `{cfg.models.policy.path}` (reference: the starting weights)\n"
        f"{which}"
        f"- Reward: {reward}\n"
        f"- KL: {estimator.kl_estimator} estimator per token in the reward, {kl}\n"
        f"- PPO: {cfg.run.steps} steps of {cfg.rollout.batch_size} prompts, {cfg.ppo.ppo_epochs} epochs, "
        f"clip {cfg.ppo.clip_eps}, gamma {estimator.gamma}, lambda {lam}, lr {cfg.ppo.lr}\n"
        f"- Decoding it was trained with (in generation_config.json): temperature {cfg.rollout.temperature}, "
        f"top_k {cfg.rollout.top_k}, top_p {cfg.rollout.top_p}, max_new_tokens {cfg.rollout.max_new_tokens}\n"
        f"{critic}\n"
        "The evaluated artifact is these weights *with* that decoding and that reward preprocessing.\n"
    )
    return out_dir
