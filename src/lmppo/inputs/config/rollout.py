"""What a step samples from: the prompts (``data``) and how responses are drawn from them (``rollout``:
the engine, the batch, the sampling, truncation, episodes)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from lmppo.inputs.config.section import Section


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
    tools: list[str] = Field(
        [],
        description="tools the policy may call, each 'path/to/file.py:function' or 'module:function' (its JSON "
        "schema from its type hints and docstring), 'mcp:<command>' (an MCP server over stdio) or an MCP "
        "server's http(s) URL (streamable HTTP): their schemas reach the model through its chat template "
        "(tools=), and a ToolEnvironment answers the calls (docs/multiturn.md)",
    )
    environment_workers: int = Field(
        32,
        gt=0,
        description="environment: resets and steps of one turn run concurrently, at most this many at once "
        "(async environments on an event loop, plain ones on threads)",
    )
    environment_timeout_s: float = Field(
        120.0,
        gt=0,
        description="environment: seconds an environment's reset or step may take; one that overruns ends its "
        "episode as truncated (episode/timeouts), and a turn where more than half overrun stops the run",
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
