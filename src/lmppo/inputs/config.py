"""Run configuration: pydantic models for every section, YAML loading and ``a.b=c`` overrides.

Every default of the project lives here. Unknown keys are errors that name the key they most likely
mean (also for other trainers' names: ``learning_rate`` -> ``ppo.lr``); impossible values say what is
allowed; each problem names the override or file it came from. ``load_config(path, overrides)`` is the
one entry point.
"""

from __future__ import annotations

import copy
import difflib
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lmppo.errors import LmppoError
from lmppo.math.estimators import ESTIMATORS

Dtype = Literal["float32", "bfloat16", "float16"]


class Section(BaseModel):
    """Base of every section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraConfig(Section):
    """LoRA adapters (peft) on a trained model; ``enabled: false`` trains all weights."""

    enabled: bool = Field(False, description="train LoRA adapters instead of every weight")
    r: int = Field(8, gt=0, description="adapter rank")
    alpha: float = Field(16.0, gt=0, description="scale: the adapter's update is multiplied by alpha / r")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    target_modules: list[str] | Literal["all-linear"] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="module names that get adapters, or all-linear (every linear layer but the output head)",
    )


class ModelSource(Section):
    """Where a model comes from: a local transformers directory, or a GGUF file inside it."""

    path: str = Field(
        description="a transformers model directory, a .gguf file, or a hub id already in the local HF cache"
    )
    gguf_file: str | None = Field(None, description="file name of a GGUF checkpoint inside `path`")
    dtype: Dtype | None = Field(
        None,
        description="weights' dtype; unset = by run.precision: bfloat16 for frozen weights (reference, reward "
        "model, LoRA bases) under bf16, float32 for every trained weight and under fp32",
    )
    quantize: Literal["int8", "nf4"] | None = Field(
        None,
        description="frozen weights only (reference, reward model, a LoRA policy's base: QLoRA): the decoder's "
        "linear layers in 8 bits (int8, weight-only) or 4-bit NormalFloat (nf4) with torchao; embeddings and "
        "heads stay in `dtype`. docs/memory.md measures the log-prob and score error",
    )
    offload: Literal["none", "model", "layers"] = Field(
        "none",
        description="frozen models on CUDA only: weights in pinned host memory, brought to the GPU whole for "
        "each pass (model) or one layer at a time (layers)",
    )
    trust_remote_code: bool = Field(
        False, description="run the model's own modelling code from its directory"
    )
    chat_template: str | None = Field(None, description="Jinja template overriding the tokenizer's own")


class ValueConfig(Section):
    """The critic: a separate network, or a scalar head on the policy's backbone (``shared``)."""

    mode: Literal["separate", "shared"] = Field(
        "separate",
        description="separate = its own network (init_from), shared = a scalar head on the policy's trunk",
    )
    init_from: Literal["reward", "policy"] = Field("reward", description="backbone of a separate critic")
    path: str | None = Field(
        None,
        description="a critic an earlier run saved (its final/value/ or best/value/) to start from, of the "
        "same mode; null = the policy directory's value/ when it holds one of this mode, else a new critic",
    )
    lora: LoraConfig = LoraConfig()


class ModelsConfig(Section):
    """The four models: the trained policy, its frozen reference and the critic (the reward is its own section)."""

    policy: ModelSource = Field(description="the model PPO trains, usually an SFT checkpoint")
    policy_lora: LoraConfig = LoraConfig()
    reference: ModelSource | None = Field(
        None, description="defaults to the policy's starting weights (the adapter disabled with LoRA)"
    )
    value: ValueConfig = ValueConfig()


class RewardSource(Section):
    """One reward: a learned reward model, a programmatic ``module:function`` *or* a reward server's URL, and its preprocessing
    (in this order: missing-EOS penalty, running normalisation, clip)."""

    model: ModelSource | None = Field(
        None,
        description="a learned reward model (sequence classification), read with its own tokenizer and template",
    )
    function: str | None = Field(
        None,
        description="'package.module:function' or 'path/to/file.py:function' taking (prompts, responses)",
    )
    url: str | None = Field(
        None,
        description="a reward server (`lmppo serve-rm`, or any speaking its JSON: docs/rewards.md): "
        "POSTed prompts and responses, answering one reward per response",
    )
    url_timeout_s: float = Field(
        30.0,
        gt=0,
        description="reward.url: seconds a whole request may take (connect, send, the whole answer), however "
        "slowly the server answers",
    )
    url_retries: int = Field(
        3,
        ge=0,
        description="reward.url: retries of a request that failed in transit, timed out or got HTTP 5xx, after "
        "pauses of 0.5, 1, 2, ... s",
    )
    url_token_env: str = Field(
        "LMPPO_REWARD_TOKEN",
        description="reward.url: the environment variable holding the server's bearer token (sent when set; "
        "never written to a file)",
    )
    url_proxy: str | None = Field(
        None, description="reward.url: an HTTP proxy to reach the server through (none unless set here)"
    )
    batch_size: int = Field(16, gt=0, description="rows per reward-model forward, function call or request")
    batch_tokens: int | None = Field(
        None,
        gt=0,
        description="a token budget per reward-model forward instead of batch_size rows: inputs grouped by "
        "length, at most this many of the RM's tokens each (padding included)",
    )
    max_length: int | None = Field(None, gt=0, description="truncate RM inputs (its own tokens)")
    missing_eos_penalty: float | None = Field(
        None,
        description="subtracted from the score of truncated rows (no stop token); needs rollout.truncation=terminal",
    )
    clip: float | None = Field(None, gt=0, description="clip scores to [-clip, clip]")
    normalize: bool = Field(False, description="running mean/std normalisation of scores")

    @model_validator(mode="after")
    def _url_is_plain_http(self) -> RewardSource:
        if self.url is not None:
            check_reward_url(self.url)
        return self

    @property
    def source_count(self) -> int:
        """How many of model, function and url are set (a source needs exactly one)."""
        return sum(value is not None for value in (self.model, self.function, self.url))


SOURCE_KEYS = tuple(RewardSource.model_fields)


def check_reward_url(url: str) -> None:
    """A reward server's URL: http or https to a host and a port a connection can name, with no credentials
    in it (they would be written to config.yaml and every checkpoint's manifest, and echoed in errors)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
    except ValueError as err:  # an unclosed [ of an IPv6 address; not echoed, it may hold credentials
        raise ValueError(f"reward.url is no URL ({err}); give one like http://host:8000/score") from None
    if parts.username or parts.password:
        raise ValueError(
            "reward.url holds credentials (user:password@), which would be written to config.yaml and every "
            "checkpoint: remove them and put the server's token in the environment variable "
            "reward.url_token_env names (LMPPO_REWARD_TOKEN)"
        )
    if parts.scheme not in ("http", "https"):
        raise ValueError(
            f"reward.url {url!r} is not an http(s) URL of a server; give one like http://host:8000/score"
        )
    if not parts.hostname:
        raise ValueError(
            f"reward.url {url!r} names no host; give the server's address, like http://host:8000/score"
        )
    try:
        port = parts.port
    except ValueError:  # not a number, or past 65535
        port = 0
    if port == 0:
        raise ValueError(
            f"reward.url {url!r} has the port {parts.netloc.rpartition(':')[2]!r}, which no server listens on: "
            "a port is a number from 1 to 65535; give the server's (lmppo serve-rm --port), like "
            "http://host:8000/score"
        )


class RewardComponent(RewardSource):
    """One of several rewards (``reward.components``): its weighted, preprocessed score is summed."""

    name: str = Field(
        pattern=r"^[A-Za-z0-9_-]+$", description="names its metrics: reward/<name>/raw, reward/<name>/used"
    )
    weight: float = Field(1.0, description="its preprocessed score's weight in the sum")

    @model_validator(mode="after")
    def _exactly_one_source(self) -> RewardComponent:
        if self.source_count != 1:
            raise ValueError(f"reward component {self.name!r}: set exactly one of model, function or url")
        return self


class RewardGate(Section):
    """Llama 2's safety gate: rows whose ``component`` scores (raw) below ``below`` get that component's
    preprocessed score alone instead of the weighted sum."""

    component: str = Field(description="the name of the gating component")
    below: float = Field(description="raw score under which a row gets the gating component's score alone")


class RewardConfig(RewardSource):
    """The reward: one source (``model`` or ``function``, with its preprocessing here), or ``components``,
    several weighted sources each with its own preprocessing (and an optional ``gate``)."""

    components: list[RewardComponent] = []
    gate: RewardGate | None = None
    overlong_buffer: int | None = Field(
        None,
        gt=0,
        description="DAPO's overlong shaping: over the last N tokens before the length limit "
        "(rollout.max_new_tokens; an episode's max_total_tokens) the score loses overlong_penalty x the "
        "share of those N tokens used, all of it at the limit; null = off",
    )
    overlong_penalty: float = Field(1.0, gt=0, description="what reward.overlong_buffer takes at the limit")

    @model_validator(mode="after")
    def _one_shape(self) -> RewardConfig:
        if not self.components:
            if self.source_count != 1:
                raise ValueError(
                    "set exactly one of reward.model (a reward model), reward.function ('module:fn') or "
                    "reward.url (a reward server), or a list of reward.components"
                )
            if self.gate is not None:
                raise ValueError("reward.gate picks between reward.components; list the components first")
            return self
        beside = [key for key in SOURCE_KEYS if getattr(self, key) != RewardSource.model_fields[key].default]
        if beside:
            raise ValueError(
                f"reward.components is set, so reward.{beside[0]} has no source to apply to; move "
                f"{', '.join(f'reward.{key}' for key in beside)} into each component"
            )
        names = [component.name for component in self.components]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(
                f"reward.components: the name {twice[0]!r} is used twice; give each a unique name"
            )
        if self.gate is not None and self.gate.component not in names:
            raise ValueError(
                f"reward.gate.component={self.gate.component!r} is not one of the components {names}"
            )
        return self

    @property
    def learned(self) -> bool:
        """Whether reward models give the whole score: its words are then "RM score", else "reward"."""
        return all(source.model is not None for source in self.sources())

    def sources(self) -> list[RewardComponent]:
        """The components; the one-source shorthand is one component named "reward" of weight 1."""
        if self.components:
            return list(self.components)
        return [RewardComponent(name="reward", **{key: getattr(self, key) for key in SOURCE_KEYS})]


class DataConfig(Section):
    """Prompts to train on and held-out data to evaluate on."""

    prompts: str | list[str | dict[str, Any]] = Field(
        description="a JSONL, Parquet or CSV file, a directory saved by datasets' save_to_disk, a hub dataset "
        "name (owner/name, where the hub is reachable), or the rows themselves; each row's prompt is a string "
        "or a list of chat messages, in the column data.prompt_key"
    )
    prompt_key: str | None = Field(
        None,
        description="the column holding each row's prompt (text, or a list of {role, content} messages); "
        "null = 'prompt', else 'messages'",
    )
    eval_prompts: str | list[str | dict[str, Any]] | None = Field(
        None,
        description="held-out prompts (same formats and prompt_key), evaluated every run.eval_every steps",
    )
    eval_judge: str | None = Field(
        None,
        description="'module:function' or 'file.py:function', (prompt, response) -> float: the held-out "
        "judge of `lmppo eval` (eval/gold_score), e.g. 1.0 when a response meets the target",
    )
    eval_demonstrations: str | None = Field(
        None,
        description="JSONL of held-out {prompt, response} (SFT data the policy was not trained on): their "
        "perplexity under the policy at every evaluation is the alignment tax (eval/demo_ppl)",
    )
    split: str | None = Field(None, description="split of a DatasetDict saved with save_to_disk")
    slice_key: str | None = Field(
        "type",
        description="the prompt-row field naming a prompt's slice (task type, source): the reward pre-flight "
        "reports the RM score per slice when every row has it",
    )
    shuffle: bool = Field(True, description="reshuffle the prompts every epoch (seeded by run.seed)")
    raw_prompts: bool = Field(False, description="feed prompts as plain text, without a chat template")
    max_prompt_length: int | None = Field(
        None,
        gt=0,
        description="longest rendered prompt in policy tokens; longer ones fail (or truncate_prompts)",
    )
    truncate_prompts: bool = Field(False, description="cut long prompts (from the left) instead of failing")
    ptx_demonstrations: str | None = Field(None, description="JSONL of {prompt, response} for PPO-ptx")


class RolloutConfig(Section):
    """Sampling: the engine, the batch of prompts per step and how responses are drawn and cut."""

    engine: Literal["hf", "vllm"] = Field(
        "hf",
        description="hf: transformers decode loop on the trained module; vllm: an in-process vLLM engine "
        "synced after every update (docs/engines.md)",
    )
    vllm_kv_cache_gb: int = Field(1, ge=1, description="engine=vllm: the engine's CPU KV cache, whole GiB")
    vllm_weight_sync: Literal["merged", "lora"] = Field(
        "merged",
        description="engine=vllm: 'merged' = push every weight with the LoRA adapters folded in; 'lora' = push "
        "only the adapters (needs models.policy_lora): a tiny sync, but vLLM's LoRA kernels then run beside "
        "every linear in decode (docs/engines.md: measured slower on CPU)",
    )
    batch_size: int = Field(16, gt=0, description="prompts per PPO step (global, all ranks)")
    samples_per_prompt: int = Field(
        1,
        gt=0,
        description="responses sampled per prompt, one group: the rank that holds a prompt samples all of "
        "them, so group baselines (ppo.advantage=grpo, dr_grpo, rloo) always see whole groups",
    )
    max_new_tokens: int = Field(32, gt=0, description="response length limit; longer responses are truncated")
    temperature: float = Field(1.0, gt=0, description="sampling temperature; logp_old is taken at it")
    top_k: int = Field(0, ge=0, description="0 = off")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling; 1 = off")
    stop_token_ids: list[int] = Field([], description="extra stop ids besides the tokenizer's EOS")
    asynchronous: bool = Field(
        False,
        description="one-step-off: the engine samples the next step's batch on a worker thread while the "
        "trainer updates on this one (one policy version behind; the ratio uses the sampling log-probs). "
        "engine=hf then decodes on its own copy of the policy (docs/engines.md)",
    )
    max_rollout_age: int | None = Field(
        None,
        ge=0,
        description="policy versions a rollout may lag before it is regenerated; null = 0, or 1 with "
        "rollout.asynchronous",
    )
    truncation: Literal["terminal", "bootstrap"] = Field(
        "terminal",
        description="rows cut at max_new_tokens: 'terminal' = scored by the reward at their last token, no "
        "bootstrap (the length limit is part of the task); 'bootstrap' = unfinished, no score, GAE "
        "bootstraps from V(state after the last token)",
    )
    environment: str | None = Field(
        None,
        description="multi-turn episodes: an environment class, 'path/to/file.py:MyEnv' or 'module:MyEnv', "
        "that answers each turn of the policy (tool results, a user's next turn) until it says done; null = "
        "one response per prompt (docs/multiturn.md)",
    )
    max_turns: int = Field(
        4,
        gt=0,
        description="environment: the policy's turns per episode at most; one still going is truncated",
    )
    max_total_tokens: int | None = Field(
        None,
        gt=0,
        description="environment: the tokens after the prompt per episode at most, actions and context; "
        "null = max_turns x max_new_tokens",
    )
    dynamic_sampling: bool = Field(
        False,
        description="DAPO: drop the groups whose responses all scored the same (a group baseline learns "
        "nothing from them) and sample more prompts until the batch is full; needs samples_per_prompt >= 2",
    )
    dynamic_sampling_rounds: int = Field(
        3,
        ge=1,
        description="dynamic_sampling: extra generation rounds per step at most; a batch still short then "
        "keeps flat groups (rollout/flat_groups_kept)",
    )
    generation_batch_tokens: int | None = Field(
        None,
        gt=0,
        description="engine=hf: a token budget per decode batch: prompts sampled in batches whose KV caches "
        "hold at most this many prompt + max_new_tokens positions; null = the whole batch at once",
    )
    forward_batch_size: int | None = Field(None, gt=0, description="micro-batch of the stored passes")
    forward_batch_tokens: int | None = Field(
        None,
        gt=0,
        description="a token budget per forward of the stored passes (reference, values) instead: rows "
        "grouped by length, at most this many query + response positions each (padding included)",
    )

    @property
    def responses_per_step(self) -> int:
        """Sequences sampled per PPO step, all ranks: the rows ``ppo.minibatch_size`` counts in."""
        return self.batch_size * self.samples_per_prompt

    @model_validator(mode="after")
    def _rollout_age(self) -> RolloutConfig:
        if self.max_rollout_age is None:
            self.max_rollout_age = int(self.asynchronous)
        elif self.asynchronous and self.max_rollout_age < 1:
            raise ValueError(
                "rollout.asynchronous samples each batch one policy version behind the update, and "
                f"rollout.max_rollout_age={self.max_rollout_age} allows none; set it to 1 (or leave it unset)"
            )
        return self

    @model_validator(mode="after")
    def _dynamic_sampling_needs_groups(self) -> RolloutConfig:
        if self.dynamic_sampling and self.samples_per_prompt < 2:
            raise ValueError(
                "rollout.dynamic_sampling drops the groups whose samples all scored the same, and "
                f"rollout.samples_per_prompt={self.samples_per_prompt} makes groups of one; set it to 2 or more"
            )
        if self.dynamic_sampling and self.asynchronous:
            raise ValueError(
                "rollout.dynamic_sampling samples again when a batch is short, and rollout.asynchronous has "
                "sampled the next batch already; set one of them to false"
            )
        return self

    @model_validator(mode="after")
    def _generation_batches_on_hf(self) -> RolloutConfig:
        if self.generation_batch_tokens is not None and self.engine == "vllm":
            raise ValueError(
                "rollout.generation_batch_tokens sizes the transformers decode loop's batches, and "
                "rollout.engine=vllm schedules its own (rollout.vllm_kv_cache_gb); unset one of them"
            )
        return self

    @model_validator(mode="after")
    def _one_forward_batching(self) -> RolloutConfig:
        if self.forward_batch_size is not None and self.forward_batch_tokens is not None:
            raise ValueError(
                "set rollout.forward_batch_size (rows) or rollout.forward_batch_tokens (a token budget), not both"
            )
        return self


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


class GuardsConfig(Section):
    """Abort rules checked every step; ``null`` turns a rule off (see docs/metrics.md for ranges)."""

    enabled: bool = Field(
        True, description="abort a run that breaks a rule, keeping the last good checkpoint"
    )
    nonfinite_patience: int = Field(3, gt=0, description="consecutive steps with non-finite values")
    value_loss_max: float | None = Field(1000.0, gt=0, description="value/loss ceiling")
    kl_max: float | None = Field(30.0, gt=0, description="kl/ref budget, nats per sequence")
    entropy_min: float | None = Field(1e-3, ge=0, description="policy/entropy floor, nats per token")
    length_min: float | None = Field(None, ge=0, description="response/length floor, tokens")
    length_max: float | None = Field(None, gt=0, description="response/length ceiling, tokens")
    eos_frac_min: float | None = Field(
        None, ge=0, le=1, description="floor of the share of responses that end"
    )
    clip_frac_max: float | None = Field(0.5, gt=0, le=1, description="policy/clip_frac ceiling")
    max_policy_lag: int | None = Field(None, ge=0, description="lag/policy_versions ceiling")
    reward_without_eval_patience: int | None = Field(
        3,
        gt=0,
        description="evaluations over which the training RM score may rise (beyond twice its standard error) "
        "without the held-out score beating its value at the window's start",
    )
    warmup_steps: int = Field(5, ge=0, description="rate and length rules start after this step")


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


class RunConfig(Section):
    """The run: algorithm, length, seed, device and numerics, checkpoints and held-out evaluation."""

    algorithm: Literal["ppo", "best_of_n"] = Field(
        "ppo",
        description="ppo (lmppo ppo) or best_of_n (lmppo best-of-n: rejection sampling + SFT on the winners, "
        "one round per step, the best_of_n section)",
    )
    output_dir: str = Field(
        "runs/ppo", description="the run directory: checkpoints, metrics, the final policy"
    )
    steps: int = Field(100, gt=0, description="PPO steps (rollout + update), or best-of-n rounds, in the run")
    seed: int = Field(0, description="seeds the prompts' order, the sampling and every initialisation")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = CUDA when present, else CPU")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto",
        description="forward passes of all four models: bf16 = under bf16 autocast with fp32 master weights "
        "and optimizer state; auto = bf16 on a CUDA device that supports it and on a CPU with AMX, else fp32 "
        "(the run prints its choice and why)",
    )
    fp32_matmul_precision: Literal["highest", "high", "medium"] = Field(
        "highest",
        description="how fp32 matrix products compute (torch.set_float32_matmul_precision): highest = "
        "fp32; high = TF32 on NVIDIA GPUs; medium = bf16 inputs with fp32 sums where a fast kernel exists "
        "(oneDNN on CPUs with AVX512-BF16 or AMX: 'fast fp32', measured in docs/performance.md)",
    )
    threads: int | None = Field(None, gt=0, description="torch CPU threads (default: all cores)")
    compile: bool = Field(
        False,
        description="torch.compile the decoder layers for the update and the stored passes (the decode loop "
        "stays eager): fused element-wise kernels after a compile of about a minute, cached on disk so the "
        "next run starts in seconds; on a CPU it needs a C++ compiler (docs/performance.md)",
    )
    oom_retries: int = Field(
        4,
        ge=0,
        description="out of memory in a phase (generation, a stored pass, the update) halves its token budget "
        "and redoes it, this many times per phase at most, for the rest of the run (one process; "
        "docs/memory.md); 0 = stop at the first",
    )
    checkpoint_every: int = Field(0, ge=0, description="steps between checkpoints; 0 = at the end only")
    keep_last: int = Field(
        2, gt=0, description="newest checkpoints kept (best/ and the newest good one are kept besides)"
    )
    eval_every: int = Field(
        0,
        ge=0,
        description="steps between held-out evaluations of data.eval_prompts (also one at step 0, the "
        "starting policy); 0 = off",
    )
    eval_batch_size: int = Field(32, gt=0, description="held-out prompts sampled per batch")

    @model_validator(mode="after")
    def _no_fp16(self) -> RunConfig:
        if self.precision == "fp16":
            raise ValueError(
                "run.precision=fp16 is not supported: fp16 training needs a loss scaler whose state every "
                "checkpoint would carry, and its range overflows on large logits; use run.precision=bf16 "
                "(CPUs, NVIDIA Ampere and newer) or fp32"
            )
        return self


class DistributedConfig(Section):
    """How the models are spread over the ranks ``torchrun`` starts (one process ignores this section)."""

    strategy: Literal["ddp", "fsdp2"] = Field(
        "ddp",
        description="ddp = every rank holds full copies and all-reduces gradients; fsdp2 = torch's fully_shard: "
        "the trained models (and the frozen ones, see shard_frozen) are split over the ranks, per decoder layer",
    )
    shard_frozen: bool = Field(
        True, description="under fsdp2, also shard the reference and the reward model (else replicated)"
    )
    checkpoint: Literal["full", "sharded"] = Field(
        "full",
        description="under fsdp2: full = rank 0 writes whole tensors (resumable anywhere; rank 0's host memory "
        "holds the trained state once); sharded = every rank writes its own shards (for trained state larger "
        "than one host's memory)",
    )
    timeout_s: float = Field(
        600.0,
        gt=0,
        description="seconds a collective may wait for the other ranks before this rank gives up (a lost "
        "rank); size it above the slowest step's longest wait: a checkpoint save, a long generation",
    )


class DiagnosisConfig(Section):
    """Thresholds of the failure-mode rules of ``lmppo diagnose`` (lmppo.runs.diagnose; defaults from the
    seeds), how often a run shows them live, and the reward pre-flight (lmppo.runs.preflight) before step
    1."""

    warn_every: int | None = Field(
        50, gt=0, description="a rule found live is shown again only after this many steps (null: not live)"
    )
    preflight_batches: int = Field(
        2,
        ge=0,
        description="rollout.batch_size-sized batches of the starting policy's samples the reward "
        "pre-flight scores before step 1 (0: no pre-flight)",
    )
    length_corr_high: float = Field(
        0.5,
        gt=0,
        le=1,
        description="|Spearman| of the reward with response length that counts as a length bias",
    )
    eos_corr_high: float = Field(
        0.5,
        gt=0,
        le=1,
        description="a correlation of the reward with ending on EOS below minus this: cut responses are favoured",
    )

    min_steps: int = Field(5, gt=1, description="steps of its metrics a rule needs before it judges")
    window: float = Field(
        0.25, gt=0, le=0.5, description="share of the steps averaged at each end of a trend"
    )
    kl_hacking_nats: float = Field(
        10.0,
        gt=0,
        description="kl/ref above this is the usual sign of reward hacking (the seeds: 10-20 nats)",
    )
    reward_rise_std: float = Field(
        1.0, gt=0, description="a trend in reward/rm_score counts when it exceeds this many std of its values"
    )
    held_out_keep: float = Field(
        0.5,
        ge=0,
        le=1,
        description="over-optimisation when the last held-out score kept less than this share of its best gain",
    )
    clip_frac_low: float = Field(
        0.005, ge=0, description="policy/clip_frac this low means the updates are tiny"
    )
    clip_frac_high: float = Field(
        0.3, gt=0, description="above this the batch is over-used (the seeds: ~0.3)"
    )
    entropy_floor: float = Field(
        0.2, gt=0, lt=1, description="entropy below this share of its start: collapse"
    )
    truncated_frac_high: float = Field(
        0.5, gt=0, le=1, description="share of responses cut at max_new_tokens"
    )
    length_shrink: float = Field(0.3, gt=0, lt=1, description="response length below this share of its start")
    value_loss_growth: float = Field(
        5.0, gt=1, description="value/loss growing this many times: the critic diverges"
    )


class LoggingConfig(Section):
    """Where metrics go and how progress is shown."""

    sinks: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = Field(
        ["jsonl"],
        description="where metrics go; jsonl (metrics.jsonl in the run directory) is always written",
    )
    quiet: bool = Field(False, description="plain log lines instead of a live progress display")
    run_name: str | None = Field(None, description="the run's name in W&B or MLflow (default: theirs)")


class Config(Section):
    models: ModelsConfig
    reward: RewardConfig
    data: DataConfig
    rollout: RolloutConfig = RolloutConfig()
    ppo: PPOConfig = PPOConfig()
    kl: KLConfig = KLConfig()
    best_of_n: BestOfNConfig = BestOfNConfig()
    guards: GuardsConfig = GuardsConfig()
    run: RunConfig = RunConfig()
    distributed: DistributedConfig = DistributedConfig()
    diagnosis: DiagnosisConfig = DiagnosisConfig()
    logging: LoggingConfig = LoggingConfig()

    @model_validator(mode="after")
    def _missing_eos_penalty_needs_scored_truncations(self) -> Config:
        penalised = [c for c in self.reward.sources() if c.missing_eos_penalty is not None]
        if penalised and self.rollout.truncation == "bootstrap":
            key = "reward" if not self.reward.components else f"reward component {penalised[0].name!r}"
            raise ValueError(
                f"{key}'s missing_eos_penalty penalises truncated rows' scores, but rollout.truncation=bootstrap "
                "gives truncated rows no score: set rollout.truncation=terminal or remove the penalty"
            )
        return self

    @model_validator(mode="after")
    def _sharded_checkpoints_need_shards(self) -> Config:
        if self.distributed.checkpoint == "sharded" and self.distributed.strategy != "fsdp2":
            raise ValueError(
                "distributed.checkpoint=sharded writes each rank's FSDP2 shards, and distributed.strategy="
                f"{self.distributed.strategy} has none; set distributed.strategy=fsdp2 or distributed.checkpoint=full"
            )
        return self

    @model_validator(mode="after")
    def _lora_sync_needs_lora(self) -> Config:
        if self.rollout.vllm_weight_sync == "lora" and not self.models.policy_lora.enabled:
            raise ValueError(
                "rollout.vllm_weight_sync=lora pushes the policy's LoRA adapters, and models.policy_lora is off: "
                "set models.policy_lora.enabled=true or rollout.vllm_weight_sync=merged"
            )
        return self

    @model_validator(mode="after")
    def _critic_free_fits(self) -> Config:
        advantage, n = self.ppo.advantage, self.rollout.samples_per_prompt
        estimator = ESTIMATORS[advantage]
        if self.run.algorithm == "best_of_n" and n < 2:
            raise ValueError(
                f"best-of-n keeps the best of rollout.samples_per_prompt responses per prompt, and it is {n}; "
                "set rollout.samples_per_prompt to K >= 2 (4 or 8 is usual)"
            )
        if estimator.groups and n < 2:
            raise ValueError(
                f"ppo.advantage={advantage} compares the samples of one prompt, and rollout.samples_per_prompt"
                f"={n} draws one; set rollout.samples_per_prompt to 2 or more (4-16 is usual)"
            )
        if estimator.critic:
            return self
        if self.rollout.truncation == "bootstrap":
            raise ValueError(
                f"rollout.truncation=bootstrap values a truncated row by the critic, and ppo.advantage="
                f"{advantage} has none; set rollout.truncation=terminal or ppo.advantage=gae"
            )
        if self.ppo.critic_warmup_steps:
            raise ValueError(
                f"ppo.critic_warmup_steps trains the critic alone, and ppo.advantage={advantage} has none; "
                "remove it or set ppo.advantage=gae"
            )
        lams = [k for k in ("lam_policy", "lam_critic") if getattr(self.ppo, k) is not None]
        if lams:
            raise ValueError(
                f"ppo.{lams[0]} is a lambda of GAE over the critic's values, and ppo.advantage={advantage} "
                "has no critic (its return is the reward-to-go); remove it or set ppo.advantage=gae"
            )
        return self

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


class TrainingStage(Section):
    """Optimisation settings of a supervised stage (SFT or reward-model training): AdamW, cosine schedule."""

    epochs: int = Field(1, gt=0, description="passes over the data")
    lr: float = Field(1e-5, gt=0, description="AdamW's peak learning rate")
    batch_size: int = Field(16, gt=0, description="examples per optimiser step")


class SupervisedConfig(TrainingStage):
    """``lmppo sft`` (demonstrations) and ``lmppo train-rm`` (preference pairs): one model, one JSONL file."""

    model: ModelSource
    data: str = Field(
        description="JSONL: {prompt, response} rows for sft, {prompt, chosen, rejected} for train-rm"
    )
    eval_data: str | None = Field(
        None, description="held-out rows of the same shape, evaluated when training ends"
    )
    seed: int = Field(0, description="seeds the data order and initialisation")
    output_dir: str = Field(description="where the trained model is saved")
    lora: LoraConfig = Field(LoraConfig(), description="train LoRA adapters (merged into the saved model)")

    @model_validator(mode="after")
    def _trains_plain_weights(self) -> SupervisedConfig:
        if self.model.quantize or self.model.offload != "none":
            raise ValueError(
                "model.quantize and model.offload are for the frozen models of a PPO run (reference, reward "
                "model, a LoRA policy's base); a supervised stage saves the weights it trains: remove them"
            )
        return self


class QuickstartConfig(Section):
    """``lmppo quickstart``: the two supervised stages and the PPO run on the toy world."""

    sft: TrainingStage
    reward_model: TrainingStage | None = None  # None: the task's reward is programmatic (--task tools)
    ppo_run: Config


# --------------------------------------------------------------------------------------------------
# Loading, overrides and readable errors
# --------------------------------------------------------------------------------------------------


def load_config(
    path: str | Path | None = None,
    overrides: list[str] = (),
    base: dict | None = None,
    schema: type[Section] = Config,
) -> Section:
    """Read a YAML file (or start from ``base``), apply ``section.key=value`` overrides, validate."""
    raw: dict[str, Any] = copy.deepcopy(base or {}) if path is None else read_yaml(path)
    for override in overrides:
        apply_override(raw, override)
    return validate_config(raw, source=str(path) if path else "config", schema=schema, overrides=overrides)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A config file's sections as plain data, not yet validated."""
    path = Path(path)
    if path.is_dir():
        raise LmppoError(f"config file {path} is a directory; pass the path of a YAML config file")
    if not path.is_file():
        raise LmppoError(f"config file {path} does not exist; pass the path of a YAML config")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise LmppoError(f"config file {path} is not valid YAML: {err}") from err
    if not isinstance(raw, dict):
        raise LmppoError(f"config file {path} must hold a mapping of sections, got {type(raw).__name__}")
    return raw


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Set ``a.b.c=value`` in a nested dict; the value is parsed as YAML (numbers, bools, lists)."""
    key, sep, value = override.partition("=")
    if not sep or not key:
        raise LmppoError(f"override {override!r} is not of the form section.key=value")
    *parents, leaf = _override_path(override)
    node = raw
    for part in parents:
        if isinstance(node, dict) and node.get(part) is None:  # an unset optional section (models.reference)
            node[part] = {}
        node = node[_list_index(node, part, override)] if isinstance(node, list) else node[part]
        if not isinstance(node, dict | list):
            raise LmppoError(f"override {override!r}: {part!r} is a value, not a section")
    node[_list_index(node, leaf, override) if isinstance(node, list) else leaf] = yaml.safe_load(value)


def _override_path(override: str) -> list[str]:
    """The location an override sets: ``reward.components.1.weight=2`` -> reward, components, 1, weight."""
    return override.partition("=")[0].strip().split(".")


def _list_index(node: list, part: str, override: str) -> int:
    """``part`` as an index into a list of the config (``reward.components.1.weight=2``)."""
    if not part.isdigit() or int(part) >= len(node):
        raise LmppoError(
            f"override {override!r}: {part!r} is not an index of that list (it has {len(node)} items: 0 to "
            f"{len(node) - 1})"
        )
    return int(part)


def validate_config(
    raw: dict[str, Any],
    source: str = "config",
    schema: type[Section] = Config,
    overrides: Sequence[str] = (),
    overrides_from: str = "command line",
) -> Section:
    """``raw`` as a ``schema``, or an LmppoError listing every problem, one line each. ``overrides`` are the
    ``a.b=c`` overrides already applied to ``raw`` (given on ``overrides_from``): a problem they caused
    names them rather than ``source``."""
    try:
        return schema.model_validate(raw)
    except ValidationError as err:
        if not overrides:  # the one source: named once, above its problems
            problems = "\n".join(f"  - {_describe(e, schema)}" for e in err.errors())
            raise LmppoError(f"{source} is not a valid lmppo config:\n{problems}") from None
        problems = "\n".join(
            f"  - {_origin(e, source, overrides, overrides_from)}: {_describe(e, schema)}"
            for e in err.errors()
        )
        raise LmppoError(f"{source} with its overrides is not a valid lmppo config:\n{problems}") from None


def _origin(error: dict[str, Any], source: str, overrides: Sequence[str], overrides_from: str) -> str:
    """Where a problem came from: the last override that set its location (or a section around it), else
    ``source`` with the overrides inside its location (a cross-field check over what they changed), else
    ``source`` alone."""
    loc = [str(p) for p in error["loc"]]
    if error["type"] == "missing":  # nothing set a missing key: whoever made its section did this
        loc = loc[:-1] or loc
    setting = [o for o in overrides if _is_prefix(_override_path(o), loc)]
    if setting:
        return f"the override {_redacted(setting[-1])} ({overrides_from})"
    inside = [_redacted(o) for o in overrides if _is_prefix(loc, _override_path(o))]
    if inside:
        return f"{source} with the override{'s' * (len(inside) > 1)} {', '.join(inside)} ({overrides_from})"
    return source


def _redacted(override: str) -> str:
    """An override as said back, with a URL's credentials (user:password@) hidden."""
    return re.sub(r"(://)[^/@\s]+@", r"\1***@", override)


def _is_prefix(head: list[str], path: list[str]) -> bool:
    return path[: len(head)] == head


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


def _describe(error: dict[str, Any], schema: type[Section]) -> str:
    loc = [str(p) for p in error["loc"]]
    where = ".".join(loc) or "(top level)"
    if error["type"] == "extra_forbidden":
        return f"unknown key {where!r}: {_unknown_key_hint(loc, schema)}"
    if error["type"] == "missing":
        return f"{where} is required"
    if error["type"] == "value_error":  # our own cross-field checks: the message says it all
        return error["msg"].removeprefix("Value error, ")
    return f"{where}: {error['msg']} (got {error.get('input')!r})"


def _unknown_key_hint(loc: list[str], schema: type[Section]) -> str:
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
