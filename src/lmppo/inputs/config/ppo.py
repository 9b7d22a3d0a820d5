"""The update: PPO's (``ppo``: the advantage estimator, epochs, minibatches, clipping, losses, optimiser),
the KL penalty to the reference (``kl``) and best-of-n's (``best_of_n``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from lmppo.inputs.config.section import Section
from lmppo.math.estimators import ESTIMATORS

Advantage = Literal[tuple(ESTIMATORS)]


class PPOConfig(Section):
    """The update: the advantage estimator, PPO's epochs, minibatches, clipping, losses and optimiser."""

    advantage: Advantage = Field(
        "gae",
        description="; ".join(f"{name}: {row.about}" for name, row in ESTIMATORS.items())
        + ". All but gae are critic-free: no value model at all (docs/core.md)",
    )
    ppo_epochs: int = Field(4, gt=0, description="passes over each rollout batch")
    minibatch_size: int = Field(16, gt=0, description="responses per optimizer step (global, all ranks)")
    micro_batch_size: int | None = Field(None, gt=0, description="gradient accumulation inside a minibatch")
    micro_batch_tokens: int | None = Field(
        None,
        gt=0,
        description="gradient accumulation by a token budget instead: each micro-batch of a rank "
        "holds at most this many query + response positions (padding included)",
    )
    clip_eps: float = Field(0.2, gt=0, description="the surrogate's ratio clip: [1 - eps, 1 + eps]")
    clip_eps_high: float | None = Field(
        None,
        gt=0,
        description="the ratio's upper clip instead, [1 - clip_eps, 1 + clip_eps_high]: DAPO's clip-higher "
        "(0.28 with clip_eps 0.2) lets unlikely tokens with a positive advantage rise; null = clip_eps",
    )
    ratio_level: Literal["token", "sequence"] = Field(
        "token",
        description="the importance ratio per token, or one per response (GSPO: exp of the mean log-ratio, "
        "clipped whole; its paper clips at 3e-4 / 4e-4 and averages each response first, "
        "ppo.loss_aggregation=sequence_mean)",
    )
    value_clip_eps: float = Field(0.2, gt=0, description="how far a new value may move from the stored one")
    vf_coef: float = Field(0.5, ge=0, description="weight of the value loss")
    ent_coef: float = Field(0.0, ge=0, description="weight of the entropy bonus")
    gamma: float = Field(1.0, ge=0, le=1, description="discount per token")
    lam: float = Field(0.95, ge=0, le=1, description="GAE's lambda")
    lam_policy: float | Literal["length_adaptive"] | None = Field(
        None,
        description="the policy's advantages' lambda, decoupled from the critic's (VC-PPO); "
        "length_adaptive: VAPO's 1 - 1 / (lam_alpha x response length) per row; null = ppo.lam",
    )
    lam_critic: float | None = Field(
        None,
        ge=0,
        le=1,
        description="the critic's targets' lambda (returns = GAE(lam_critic) + V); 1.0 = the reward-to-go, "
        "VC-PPO's choice, with ppo.critic_warmup_steps its value pretraining; null = ppo.lam",
    )
    lam_alpha: float = Field(0.05, gt=0, description="lam_policy=length_adaptive's alpha (VAPO: 0.05)")
    whiten_advantages: bool = Field(True, description="advantages to mean 0, std 1 over the whole batch")
    tis_cap: float | None = Field(
        None,
        gt=1,
        description="truncated importance sampling of the engine's samples: the PPO ratio is taken "
        "against the trainer's own log-probs (one more policy pass per step) and each "
        "token's surrogate is weighted by min(p_trainer / p_engine, tis_cap); null = off",
    )
    target_approx_kl: float | None = Field(
        None, gt=0, description="stop the epochs when approx KL exceeds it"
    )
    max_grad_norm: float | None = Field(1.0, gt=0, description="gradient clipping by global norm; null = off")
    lr: float = Field(1e-5, gt=0, description="the policy's AdamW learning rate")
    value_lr: float | None = Field(None, gt=0, description="defaults to lr")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW's epsilon")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="learning-rate schedule over run.steps, after the warmup"
    )
    warmup_steps: int = Field(0, ge=0, description="steps of linear learning-rate warmup")
    ptx_coef: float = Field(0.0, ge=0, description="weight of the SFT loss on data.ptx_demonstrations")
    critic_warmup_steps: int = Field(
        0,
        ge=0,
        description="the first K steps train only the critic (the policy and its version stay as they "
        "are; rollouts still come from it): the remedy when the value loss dominates early",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="recompute each decoder layer's activations in the update's backward (policy and a "
        "separate critic): far less activation memory for about one more forward pass",
    )
    ptx_batch_size: int = Field(8, gt=0, description="demonstrations per PPO-ptx loss term")
    loss_aggregation: Literal["token_mean", "sequence_mean"] = Field(
        "token_mean",
        description="how the policy's per-token loss (and kl.in_loss's term) is averaged over a minibatch: "
        "token_mean = every response token weighs the same, so a long response weighs more; sequence_mean "
        "= each response's own token mean, then the mean over responses (GRPO's paper)",
    )

    @field_validator("lam_policy")
    @classmethod
    def _lam_in_range(cls, lam: float | str | None) -> float | str | None:
        if isinstance(lam, float) and not 0.0 <= lam <= 1.0:
            raise ValueError(f"ppo.lam_policy={lam} must be between 0 and 1 (or length_adaptive, or null)")
        return lam

    @model_validator(mode="after")
    def _micro_batches_divide(self) -> PPOConfig:
        if self.micro_batch_size is not None and self.micro_batch_tokens is not None:
            raise ValueError(
                "set ppo.micro_batch_size (rows) or ppo.micro_batch_tokens (a token budget), not both"
            )
        if self.micro_batch_size is not None and self.minibatch_size % self.micro_batch_size:
            raise ValueError(
                f"ppo.micro_batch_size={self.micro_batch_size} must divide ppo.minibatch_size={self.minibatch_size}"
            )
        return self


class KLConfig(Section):
    """The KL penalty to the reference: its estimator, coefficient (fixed or adaptive) and placement."""

    estimator: Literal["k1", "k2", "k3"] = Field(
        "k1", description="per-token KL estimator of the reward's penalty and the logged kl/ref"
    )
    in_loss: bool = Field(
        False,
        description="GRPO's placement: the KL to the reference is a loss term, beta x the k3 estimate per "
        "token (reward/kl_penalty becomes policy/kl_loss), instead of -beta x KL in the reward",
    )
    beta: float = Field(0.05, ge=0, description="initial (or fixed) KL coefficient")
    adaptive: bool = Field(False, description="steer beta toward kl.target (Ziegler et al.'s controller)")
    target: float = Field(6.0, gt=0, description="per-sequence KL the adaptive controller steers to")
    horizon: float = Field(10000.0, gt=0, description="in samples: beta moves <= 20% per horizon samples")


class BestOfNConfig(Section):
    """``lmppo best-of-n`` (``run.algorithm=best_of_n``): rejection sampling. Each step is a round: sample
    ``rollout.samples_per_prompt`` responses to each of ``rollout.batch_size`` prompts, score them with the
    run's reward, keep each prompt's best and fine-tune the policy on the winners (response-only SFT loss,
    ``ppo.lr``, minibatches of ``ppo.minibatch_size`` winners)."""

    threshold: float | None = Field(
        None,
        description="keep a prompt's best response only when its score (as the reward preprocesses it) >= this",
    )
    epochs: int = Field(1, gt=0, description="passes of the SFT loss over each round's winners")
