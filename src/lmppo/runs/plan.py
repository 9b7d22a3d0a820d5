"""The memory plan of a run, made before anything heavy is loaded: ``lmppo plan`` prints it and ``lmppo ppo``
refuses a plan that cannot fit (unless ``--force``), naming what to change.

Parameters are counted exactly: each model is built from its config on the meta device (no weights read),
with LoRA and the critic set up by the same functions a run uses. Bytes follow the seeds' table: a trained
weight is an fp32 master (4) + its gradient (4) + Adam's two moments (8) = 16 bytes, a frozen weight is its
dtype's size. The three phases of a step use memory one after the other, so the peak is the models plus the
largest phase: the rollout's KV cache, the stored passes' logits, the update's activations. Activations are
estimated per decoder layer and token from the architecture's widths with constants measured on CPU
(docs/memory.md: the plan against the measured peak of every example config).
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass, field, replace

import torch
from rich.console import Group
from rich.table import Table
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from lmppo.errors import LmppoError, with_context
from lmppo.inputs.config import Config, ModelSource, load_config
from lmppo.inputs.data import load_prompts, render_query_ids
from lmppo.inputs.resolve import (
    EngineSpec,
    RoleSpec,
    RunSpec,
    check_batches,
    frozen_sections,
    resolve,
)
from lmppo.modeling.loading import DTYPES, load_model_config, load_tokenizer, resolve_source, weight_files
from lmppo.modeling.lora import with_lora
from lmppo.modeling.models import make_value_model
from lmppo.modeling.quantize import QUANTIZED_BYTES, quantizable_linears
from lmppo.progress import size
from lmppo.runs.build import run_tool_schemas
from lmppo.sampling.prompts import prompt_room

GIB = 2**30
CUDA_CONTEXT_BYTES = GIB // 2  # the CUDA context and kernels: outside torch's allocator
# What a decoder layer keeps for its backward, per token, in hidden-wide and intermediate-wide tensors of
# the compute dtype, counted from the tensors autograd saves (benchmarks/probe_memory.py, docs/memory.md).
# On the gradient's path a layer keeps its residual stream, q, k and v after rotary (k and v repeated to
# every head), the attention's output and the MLP's gate, up and silu(gate): SAVED_HIDDEN, SAVED_MLP. A
# trained MLP (in full or by LoRA) also keeps the inputs of its linears, TRAINED_MLP_INPUTS; trained norm
# weights their normalized inputs, TRAINED_NORM_INPUTS. Measured: LoRA on attention 6.2-6.7 hidden-wide +
# 3 intermediate-wide, LoRA on every linear 8.3-8.5 + 4, trained in full 9.3-10.4 + 4. The norms keep
# NORM_INPUTS of the hidden-wide ones in float32 whatever the compute dtype (transformers upcasts in them).
SAVED_HIDDEN, SAVED_MLP, NORM_INPUTS = 6.5, 3, 2
TRAINED_MLP_INPUTS = (2, 1)  # hidden-wide, intermediate-wide
TRAINED_NORM_INPUTS = 1
# The update's logits, per response token and vocabulary entry, beyond the compute-dtype ones it keeps: their
# gradient and a copy of it (12 bytes in all measured in fp32; the log-prob sweep itself goes a chunk of rows
# at a time). A pass without gradients keeps the compute-dtype logits alone.
UPDATE_LOGIT_BYTES = 8
WORKING_HIDDEN, WORKING_MLP = 2, 3  # what one layer holds at a time in a pass without gradients
# On CPU, glibc's heap keeps the blocks it frees (lmppo maps nothing apart and never trims, so that a step
# does not fault its pages in again: modeling/models.py). The update's activations, gradients and logits come
# and go in sizes that fit each other's holes badly: a run's resident peak exceeds what the update holds at
# once by this share of it (0.79 and 0.80 measured on SmolLM2 in fp32 and on an int8 base: docs/memory.md).
# The other phases reuse the same few blocks step after step (a rollout peaking at its folded weights' copy
# kept none: docs/memory.md). torch's CUDA allocator reports allocated bytes apart (max_memory_allocated),
# so CUDA plans carry none.
CPU_HEAP_RETENTION = 0.8


@dataclass(frozen=True)
class Shape:
    """The widths of a decoder stack that size its activations and KV cache."""

    layers: int
    hidden: int
    intermediate: int
    kv_width: int  # key (= value) width per token and layer: kv heads x head dim
    vocab: int
    mlp_trained: bool = True  # a weight of the MLP is trained, in full or by LoRA
    norms_trained: bool = True

    @classmethod
    def of(cls, config, model=None) -> Shape:
        """The widths in ``config``; what ``model`` (on the meta device, LoRA set up) trains in a layer."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            intermediate=getattr(config, "intermediate_size", None) or 4 * config.hidden_size,
            kv_width=kv_heads * head_dim,
            vocab=config.vocab_size,
            **({} if model is None else trained_parts(model)),
        )

    def saved_per_token(self, act_bytes: int, checkpointing: bool) -> int:
        """Bytes the backward keeps per token over the whole stack."""
        hidden, mlp = SAVED_HIDDEN, SAVED_MLP
        if self.mlp_trained:
            hidden, mlp = hidden + TRAINED_MLP_INPUTS[0], mlp + TRAINED_MLP_INPUTS[1]
        hidden += TRAINED_NORM_INPUTS if self.norms_trained else 0
        compute_dtype = act_bytes * ((hidden - NORM_INPUTS) * self.hidden + mlp * self.intermediate)
        full_layer = int(compute_dtype) + 4 * NORM_INPUTS * self.hidden
        if checkpointing:  # each layer keeps its input; one layer is recomputed at a time
            return self.layers * act_bytes * self.hidden + full_layer
        return self.layers * full_layer

    def adapted_weights(self, target_modules: str | list[str]) -> int:
        """Weights of the decoder's linears LoRA adapts (Llama-style names; ``all-linear``: all of them)."""
        h, kv, i = self.hidden, self.kv_width, self.intermediate
        linears = {"q_proj": h * h, "k_proj": h * kv, "v_proj": h * kv, "o_proj": h * h}
        linears |= {"gate_proj": h * i, "up_proj": h * i, "down_proj": i * h}
        names = linears if target_modules == "all-linear" else target_modules
        return self.layers * sum(linears.get(name, 0) for name in names)

    def working_per_token(self, act_bytes: int) -> int:
        return act_bytes * (WORKING_HIDDEN * self.hidden + WORKING_MLP * self.intermediate)


def trained_parts(model) -> dict[str, bool]:
    """Whether ``model``'s decoder layers train a weight of their MLP and of their norms (Llama-style names)."""
    layer = next(m for m in model.modules() if type(m).__name__.endswith("DecoderLayer"))
    trained = [name for name, param in layer.named_parameters() if param.requires_grad]
    return {
        "mlp_trained": any("mlp" in name for name in trained),
        "norms_trained": any("norm" in name for name in trained),
    }


@dataclass
class ModelRow:
    """One model's standing memory: weights, and for what is trained its gradients and Adam moments."""

    role: str
    parameters: int
    dtype: str  # of the frozen weights; trained weights are float32
    trained: int
    note: str = ""
    frozen_bytes_per_param: int = 4
    shards: int = 1  # ranks its weights, gradients and Adam moments are split over (FSDP2)
    quantized: int = 0  # frozen parameters stored in `quantize`'s bits (lmppo.modeling.quantize)
    quantize: str | None = None
    offload: str = "none"  # frozen weights kept in host memory: "model" or "layers" (CUDA)
    layers: int = 1  # decoder layers: what an offloaded pass brings over one at a time

    @property
    def stored_weights(self) -> int:
        """Bytes of its weights wherever they are: frozen ones in their dtype or quantized, trained in fp32."""
        frozen = self.parameters - self.trained - self.quantized
        quantized = self.quantized * QUANTIZED_BYTES[self.quantize] if self.quantize else 0
        return int(frozen * self.frozen_bytes_per_param + quantized + self.trained * 4) // self.shards

    @property
    def weights(self) -> int:
        """Bytes of weights the device holds between passes."""
        return 0 if self.offload != "none" else self.stored_weights

    @property
    def brought(self) -> int:
        """Bytes an offloaded model brings to the device for its pass: whole, or one layer at a time."""
        if self.offload == "none":
            return 0
        return self.stored_weights if self.offload == "model" else self.stored_weights // self.layers

    @property
    def grads(self) -> int:
        return self.trained * 4 // self.shards

    @property
    def adam(self) -> int:
        return self.trained * 8 // self.shards

    @property
    def host(self) -> int:
        """Host bytes of its offloaded weights."""
        return self.stored_weights if self.offload != "none" else 0

    def gathered(self, act_bytes: int) -> int:
        """Bytes of the whole model gathered for a pass (FSDP2): trained weights in the compute dtype,
        frozen ones in their own."""
        return self.parameters * (act_bytes if self.trained else self.frozen_bytes_per_param)

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.adam


@dataclass
class MemoryPlan:
    """Per-rank memory of a run: models, the step's phases, the process itself; and what is available."""

    precision: str
    device: str
    world_size: int
    critic: bool  # a trained value model (the ladder's first rung drops it)
    prompt_tokens: int  # the longest rendered prompt the phases are sized for
    models: list[ModelRow]
    phases: dict[str, int]  # phase -> bytes; they follow one another, so the largest counts
    runtime: int  # the process before any model: interpreter, torch, CUDA context
    available: int | None  # bytes this device can still give (all ranks on it together)
    ranks_per_device: int = 1  # processes sharing the device's memory (CPU: every local rank)
    heap_retention: float = 0.0  # share of the update the allocator keeps beside it (CPU_HEAP_RETENTION)
    details: dict[str, str] = field(default_factory=dict)  # phase -> how it was sized

    @property
    def static(self) -> int:
        return sum(row.total for row in self.models)

    @property
    def host(self) -> int:
        """Host bytes of the frozen models' offloaded weights on one rank."""
        return sum(row.host for row in self.models)

    @property
    def largest(self) -> str:
        """The phase the peak comes with, counting what the heap keeps beside the update (a load ends, and
        its file pages are unmapped, before the first step: it keeps none)."""
        return max(self.phases, key=lambda phase: self.phases[phase] + self._retained_by(phase))

    def _retained_by(self, phase: str) -> int:
        return int(self.heap_retention * self.phases[phase]) if phase == "update" else 0

    @property
    def retained(self) -> int:
        """What the heap keeps beside the largest phase (the update's share on CPU; none beside another)."""
        return self._retained_by(self.largest)

    @property
    def needed_per_rank(self) -> int:
        """Bytes one rank takes beyond the running process: the models and the largest phase."""
        return self.static + self.phases[self.largest] + self.retained

    @property
    def peak(self) -> int:
        """Peak bytes of one rank."""
        return self.runtime + self.needed_per_rank

    @property
    def needed(self) -> int:
        """Bytes still to be taken from the device: the running processes already hold ``runtime``."""
        return self.ranks_per_device * self.needed_per_rank

    @property
    def fits(self) -> bool:
        return self.available is None or self.needed <= self.available


# --------------------------------------------------------------------------------------------------
# Parameter counts on the meta device
# --------------------------------------------------------------------------------------------------


def _meta_model(config, *, reward: bool = False):
    with torch.device("meta"):
        if reward:
            config.num_labels = 1
            return AutoModelForSequenceClassification.from_config(config)
        return AutoModelForCausalLM.from_config(config)


def _counts(module) -> tuple[int, int]:
    params = list(module.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def conversion_bytes(spec: ModelSource) -> int:
    """Host bytes of the weight files a 16-bit or quantized load reads while it converts them (their pages
    stay resident next to the converted copy until the load ends); 0 when the weights are used as stored."""
    if spec.dtype == "float32" and not spec.quantize:
        return 0
    return sum(path.stat().st_size for path in weight_files(resolve_source(spec)))


def _with_episode_default(err: LmppoError, cfg: Config) -> LmppoError:
    """An episode budget the user never set comes from two keys: say which, so the fix is plain."""
    r = cfg.rollout
    if r.max_total_tokens is not None or not (r.environment or r.tools):
        return err
    return with_context(
        err,
        f"rollout.max_total_tokens is unset, so an episode may take rollout.max_turns={r.max_turns} x "
        f"rollout.max_new_tokens={r.max_new_tokens} tokens: set rollout.max_total_tokens, or fewer turns or "
        "new tokens (`lmppo init --environment` sizes them to the context window)",
    )


def model_rows(cfg: Config, spec: RunSpec) -> tuple[list[ModelRow], dict[str, Shape], int]:
    """The four models' rows (parameters, dtype, trained share, shards) as the spec makes them, the
    shapes of the policy, reward models and critic, and the largest conversion a load does
    (:func:`conversion_bytes`)."""
    policy_config = load_model_config(spec.policy.source)
    # the context check the rollout makes, before any figure: a response (an episode) longer than the window
    # is no OOM
    context = getattr(policy_config, "max_position_embeddings", None)
    budget = "rollout.max_total_tokens" if spec.engine.environment else "rollout.max_new_tokens"
    try:
        prompt_room(context, spec.engine.max_episode_tokens, cfg.data.max_prompt_length, budget)
    except LmppoError as err:
        raise _with_episode_default(err, cfg) from None
    base = _meta_model(policy_config)
    quantized = quantized_count(base, spec.policy)
    policy = with_lora(base, spec.policy.lora)
    shapes = {"policy": Shape.of(policy_config, policy)}
    rows = [_row(spec.policy, *_counts(policy), quantized)]
    conversions = [conversion_bytes(spec.policy.source)]

    reference = spec.reference
    if reference.source is not None:
        model = _meta_model(load_model_config(reference.source))
        rows.append(_row(reference, _counts(model)[0], 0, quantized_count(model, reference)))
        conversions.append(conversion_bytes(reference.source))
    else:  # the policy's view (no weights of its own) or a copy of its starting weights
        rows.append(_row(reference, 0 if reference.shares else rows[0].parameters, 0))

    first_reward_model, first_reward_shape = None, None  # a critic may start from it
    for role in spec.rewards:
        if role.source is None:
            rows.append(_row(role, 0, 0))
            continue
        reward_config = load_model_config(role.source)
        frozen = _meta_model(reward_config, reward=True).requires_grad_(False)
        rows.append(_row(role, _counts(frozen)[0], 0, quantized_count(frozen, role)))
        conversions.append(conversion_bytes(role.source))
        shapes[role.role] = Shape.of(reward_config)
        if first_reward_model is None:
            first_reward_model, first_reward_shape = frozen, shapes[role.role]

    if spec.value is None:  # a critic-free estimator: no row, no memory
        return rows, shapes, max(conversions)
    sized, backbone_of = replace(spec.value, saved=None), policy  # on meta models: no saved weights read
    if spec.value.saved and not spec.value.shares:  # a saved separate critic: a backbone of its own shape
        saved_config = load_model_config(spec.value.saved)
        sized, backbone_of = replace(sized, init_from="policy"), _meta_model(saved_config)
        shapes["value"] = Shape.of(saved_config)
    elif not spec.value.shares:
        shapes["value"] = first_reward_shape if spec.value.init_from == "reward" else shapes["policy"]
    value = make_value_model(sized, backbone_of, first_reward_model)
    if not spec.value.shares:
        shapes["value"] = replace(shapes["value"], **trained_parts(value))
    rows.append(_row(spec.value, *_counts(value.head if spec.value.shares else value)))
    return rows, shapes, max(conversions)


def quantized_count(model, role: RoleSpec) -> int:
    """Parameters of ``model`` (before any LoRA) that ``role`` stores quantized."""
    if not role.quantize:
        return 0
    return sum(linear.weight.numel() for _, linear in quantizable_linears(model))


def _row(role: RoleSpec, params: int, trained: int, quantized: int = 0) -> ModelRow:
    size = DTYPES[role.dtype].itemsize if role.dtype in DTYPES else 4
    dtype = f"{role.quantize} + {role.dtype}" if role.quantize else role.dtype
    layers = load_model_config(role.source).num_hidden_layers if role.offload == "layers" else 1
    return ModelRow(
        role.role,
        params,
        dtype,
        trained,
        role.note,
        size,
        role.shards,
        quantized,
        role.quantize,
        role.offload,
        layers,
    )


# --------------------------------------------------------------------------------------------------
# The step's phases
# --------------------------------------------------------------------------------------------------


def longest_prompt(cfg: Config) -> int:
    """Tokens of the longest rendered prompt (capped by ``data.max_prompt_length``)."""
    if cfg.data.max_prompt_length and cfg.data.truncate_prompts:
        return cfg.data.max_prompt_length
    tokenizer = load_tokenizer(cfg.models.policy)
    prompts = load_prompts(cfg.data.prompts, cfg.data.split, cfg.data.prompt_key)
    # the run's environment, checked before any model loads, and the schemas of its tools (MCP servers
    # started, once per process), which every prompt carries
    tools = run_tool_schemas(cfg, tokenizer)
    if cfg.data.raw_prompts:
        lengths = [len(tokenizer(str(p))["input_ids"]) for p in prompts]
    else:
        template = cfg.models.policy.chat_template
        lengths = [len(render_query_ids(tokenizer, p, template, tools=tools)) for p in prompts]
    return max(lengths, default=1)


def phase_bytes(
    cfg: Config, spec: RunSpec, rows: list[ModelRow], shapes: dict[str, Shape], prompt_tokens: int
) -> tuple[dict[str, int], dict[str, str]]:
    """Bytes of the rollout, the stored passes and the update on one rank, and how each was sized."""
    precision, world_size = spec.precision, spec.world_size
    act = 2 if precision == "bf16" else 4
    policy, critic = shapes["policy"], shapes.get("value")
    batch = max(cfg.rollout.responses_per_step // world_size, 1)
    response = spec.engine.max_episode_tokens  # one response, or all of an episode's turns and context
    length = prompt_tokens + response
    by_role = {row.role: row for row in rows}

    rollout, rollout_how = _rollout_bytes(cfg, spec, by_role, policy, batch, prompt_tokens)

    stored, stored_how = _stored_pass_bytes(cfg, policy, act, batch, length, response)
    for source in cfg.reward.sources():  # each reward model scores its own batches, one at a time
        shape = shapes.get(f"reward {source.name}" if cfg.reward.components else "reward")
        if shape is not None:
            rm_tokens = source.batch_tokens or min(source.batch_size, batch) * (source.max_length or length)
            stored = max(stored, rm_tokens * shape.working_per_token(act))

    brought = max((row.brought for row in rows), default=0)  # an offloaded model, on the device for its pass
    if brought:
        stored += brought
        stored_how += f" + an offloaded model's weights brought over: {size(brought)}"

    # Update: the saved activations of one micro-batch (policy and a separate critic), its logits with
    # their gradient, autocast's bf16 copies of trained weights and, under DDP, the gradient buckets.
    minibatch_rows = max(cfg.ppo.minibatch_size // world_size, 1)
    if cfg.ppo.micro_batch_tokens:
        tokens = min(cfg.ppo.micro_batch_tokens, minibatch_rows * length)
        how = f"micro-batches <= {tokens} tokens"
    else:
        rows_per_micro = max((cfg.ppo.micro_batch_size or cfg.ppo.minibatch_size) // world_size, 1)
        tokens = rows_per_micro * length
        how = f"micro-batches of {rows_per_micro} x {length} tokens"
    checkpointing = cfg.ppo.gradient_checkpointing
    saved = tokens * policy.saved_per_token(act, checkpointing)
    if critic is not None:  # a separate critic (a shared one is the policy's trunk)
        saved += tokens * critic.saved_per_token(act, checkpointing)
    logits = tokens * response // length * policy.vocab * (act + UPDATE_LOGIT_BYTES)
    trained = sum(row.trained for row in rows)
    if by_role["policy"].shards > 1:  # FSDP2: what is gathered whole on top of each rank's shards
        rollout, stored, update_gathers = _gathered_bytes(cfg, by_role, shapes, act, rollout, stored)
        update = saved + logits + update_gathers  # all-gathered in the compute dtype: no autocast copies
        how += ", FSDP2 gathers per layer"
    else:
        update = (
            saved
            + logits
            + (trained * 2 if precision == "bf16" else 0)
            + (trained * 4 if world_size > 1 else 0)
        )
    how += ", checkpointed" if checkpointing else ", all activations kept"
    phases = {"rollout": rollout, "stored passes": stored, "update": update}
    details = {
        "rollout": rollout_how,
        "stored passes": stored_how,
        "update": how,
    }
    if cfg.data.eval_prompts and cfg.run.eval_every:  # held-out batches of their own size
        rows = cfg.run.eval_batch_size
        sampled, _ = _rollout_bytes(cfg, spec, by_role, policy, rows, prompt_tokens)
        kl_passes, _ = _stored_pass_bytes(cfg, policy, act, rows, length, response)
        phases["evaluation"] = max(sampled, kl_passes)
        details["evaluation"] = (
            f"{rows} held-out prompts per batch (run.eval_batch_size): sampled, then KL passes"
        )
    return phases, details


def _stored_pass_bytes(
    cfg: Config, policy: Shape, act: int, rows: int, length: int, response: int
) -> tuple[int, str]:
    """A pass without gradients over ``rows`` rows of ``length`` tokens, in the forwards the config sets:
    the working set and the logits of one forward (the log-probs are swept a chunk of rows at a time)."""
    if cfg.rollout.forward_batch_tokens:
        tokens = min(cfg.rollout.forward_batch_tokens, rows * length)
        how = f"forwards of <= {tokens} tokens"
    else:
        forward_rows = min(cfg.rollout.forward_batch_size or rows, rows)
        tokens, how = forward_rows * length, f"{forward_rows} rows x {length} tokens per forward"
    logits = tokens * response // length * policy.vocab * act
    return tokens * policy.working_per_token(act) + logits, how


def _rollout_bytes(
    cfg: Config, spec: RunSpec, by_role: dict[str, ModelRow], policy: Shape, batch: int, prompt_tokens: int
) -> tuple[int, str]:
    """The rollout on one rank: the static KV cache of the whole batch, one layer's prefill working set and
    the sampling logits (or vLLM's own cache and weights), and how it was sized."""
    act = 2 if spec.precision == "bf16" else 4
    length = prompt_tokens + spec.engine.max_episode_tokens
    if spec.engine.kind == "vllm":
        rollout = cfg.rollout.vllm_kv_cache_gb * GIB + by_role["policy"].parameters * act  # its own weights
        return rollout, f"vLLM: {cfg.rollout.vllm_kv_cache_gb} GiB KV cache + its weights"
    kv = 2 * policy.layers * policy.kv_width * act * batch * length
    rollout = kv + batch * prompt_tokens * policy.working_per_token(act) + batch * policy.vocab * 16
    rollout_how = f"KV cache of {batch} x {length} tokens: {size(kv)}"
    lora = cfg.models.policy_lora.enabled and not cfg.models.policy.quantize  # a quantized base is not folded
    if lora and by_role["policy"].shards == 1:  # fp32 base in fp32, bf16 base under bf16 (lora_merged)
        merged = act * policy.adapted_weights(cfg.models.policy_lora.target_modules)
        rollout += merged  # the decode loop's folded copy of the adapted weights (models.lora_merged)
        rollout_how += f" + LoRA folded into a copy of the adapted weights: {size(merged)}"
    return rollout, rollout_how


def add_resident_engine(
    engine: EngineSpec, rows: list[ModelRow], phases: dict[str, int], details: dict[str, str]
) -> None:
    """What the rollout engine holds while the other phases run, added to them. vLLM on a GPU with
    synchronous rollouts sleeps through them (its cache freed, its weights in host memory); elsewhere its
    weights and KV cache stay. With ``rollout.asynchronous`` the next batch decodes during the stored passes
    and the update, and ``engine: hf`` keeps a snapshot of the policy for it in every phase."""
    rollout = phases["rollout"]
    if engine.kind == "hf" and engine.asynchronous:
        policy = next(row for row in rows if row.role == "policy")
        snapshot = policy.stored_weights * policy.shards  # a whole copy on every rank
        phases["rollout"] += snapshot
        details["rollout"] += f" + the snapshot of the policy it decodes on: {size(snapshot)}"
        resident, why = phases["rollout"], "the snapshot and the next batch's decode"
    elif engine.kind == "vllm" and not engine.sleeps:
        resident, why = (
            rollout,
            "the vLLM engine stays resident" + (": sampling" if engine.asynchronous else ""),
        )
    else:
        if engine.kind == "vllm":
            details["rollout"] += "; it sleeps through the other phases"
        return
    for phase in ("stored passes", "update"):
        phases[phase] += resident
        details[phase] += f" + {why}: {size(resident)}"


def _gathered_bytes(
    cfg: Config, by_role: dict[str, ModelRow], shapes: dict[str, Shape], act: int, rollout: int, stored: int
) -> tuple[int, int, int]:
    """Under FSDP2: the rollout and the stored passes plus the model they gather whole (the policy; the
    largest of reference, reward model and critic, one at a time), and the update's gathers: two layers
    at once (one prefetched) and the root unit (embeddings, head), with one layer's fp32 gradients."""
    policy, value = by_role["policy"], by_role.get("value")
    shared = value is not None and "value" not in shapes  # only a separate critic has a shape of its own
    passes = [value.gathered(act) + (policy.gathered(act) if shared else 0)] if value else []
    frozen = [row for role, row in by_role.items() if role == "reference" or role.startswith("reward")]
    passes += [row.gathered(act) for row in frozen if row.shards > 1]
    update = 0
    for role in ("policy",) if shared or value is None else ("policy", "value"):
        shape = shapes[role]
        root = min(2 * shape.vocab * shape.hidden, by_role[role].parameters)
        layer = (by_role[role].parameters - root) // max(shape.layers, 1)
        update += (2 * layer + root) * act + layer * 4
    return rollout + policy.gathered(act), stored + max(passes, default=0), update


# --------------------------------------------------------------------------------------------------
# The device, the plan, and what to change when it does not fit
# --------------------------------------------------------------------------------------------------


def process_rss() -> int:
    """Resident bytes of this process now (Linux ``/proc``; else the peak so far)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def available_memory(device: str) -> int | None:
    """Bytes the device can still give: free CUDA memory, or the RAM the kernel calls available."""
    if device == "cuda":
        if not torch.cuda.is_available():
            return None
        free, _ = torch.cuda.mem_get_info(int(os.environ.get("LOCAL_RANK", "0")))
        return free
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_plan(
    cfg: Config,
    *,
    world_size: int | None = None,
    available: int | None = None,
    device: str | None = None,
    prompt_tokens: int | None = None,
    spec: RunSpec | None = None,
) -> MemoryPlan:
    """The plan of ``cfg`` as ``spec`` resolves it (default: on ``world_size`` ranks, this launch's, of
    ``device``) against ``available`` bytes (default: what this machine's device has free now);
    ``prompt_tokens`` defaults to the longest rendered prompt of ``data.prompts``."""
    if spec is None:
        world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
        spec = resolve(cfg, device=device, world_size=world_size, present=False)
    device, precision = spec.device.type, spec.precision
    rows, shapes, conversion = model_rows(cfg, spec)
    prompt_tokens = prompt_tokens or longest_prompt(cfg)
    phases, details = phase_bytes(cfg, spec, rows, shapes, prompt_tokens)
    add_resident_engine(spec.engine, rows, phases, details)
    if device == "cpu" and conversion:  # on CUDA the files are read into host memory, not the GPU's
        phases["loading"], details["loading"] = conversion, "weight files read while converting them"
    runtime = CUDA_CONTEXT_BYTES if device == "cuda" else process_rss()  # GPU memory is not the process's RSS
    ranks_per_device = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if device == "cpu" else 1
    return MemoryPlan(
        precision=precision,
        device=device,
        world_size=spec.world_size,
        critic=spec.estimator.critic,
        prompt_tokens=prompt_tokens,
        models=rows,
        phases=phases,
        runtime=runtime,
        available=available if available is not None else available_memory(device),
        ranks_per_device=ranks_per_device,
        heap_retention=CPU_HEAP_RETENTION if device == "cpu" else 0.0,
        details=details,
    )


def ladder(cfg: Config, plan: MemoryPlan) -> list[list[str]]:
    """The seeds' memory ladder as overrides, in their order, for the rungs this run has not taken: drop
    the critic, LoRA, quantize the frozen pair, offload (CUDA), then FSDP2 (:func:`remedies` adds ranks)."""
    rungs = []
    if plan.critic:
        rungs.append(["ppo.advantage=reinforce_pp"])
    if not cfg.models.policy_lora.enabled:
        rungs.append(["models.policy_lora.enabled=true"])
    quantize = [f"{key}.quantize=int8" for key, section in frozen_sections(cfg) if not section.quantize]
    if cfg.models.policy_lora.enabled and not cfg.models.policy.quantize:
        quantize.append("models.policy.quantize=nf4")  # QLoRA: the base the reference runs on too
    elif cfg.models.reference is None and not cfg.models.policy_lora.enabled:  # its own quantized copy
        quantize += [f"models.reference.path={cfg.models.policy.path}", "models.reference.quantize=int8"]
        if cfg.models.policy.gguf_file:
            quantize.append(f"models.reference.gguf_file={cfg.models.policy.gguf_file}")
    if quantize:
        rungs.append(quantize)
    if plan.device == "cuda":
        offload = [
            f"{key}.offload=model" for key, section in frozen_sections(cfg) if section.offload == "none"
        ]
        rungs += [offload] if offload else []
    return rungs


def remedies(cfg: Config, plan: MemoryPlan) -> list[tuple[str, int]]:
    """Config changes that shrink the plan, with the bytes each saves per rank: the memory ladder's rungs in
    the seeds' order (:func:`ladder`, FSDP2 ranks last), then the other knobs, largest saving first."""
    rungs = ladder(cfg, plan)
    if plan.world_size > 1 and cfg.distributed.strategy == "ddp":
        rungs.append(["distributed.strategy=fsdp2"])
    knobs = []
    if plan.precision == "fp32":
        knobs.append(["run.precision=bf16"])
    if not cfg.ppo.gradient_checkpointing:
        knobs.append(["ppo.gradient_checkpointing=true"])
    if plan.critic and cfg.models.value.mode == "separate" and not cfg.models.value.lora.enabled:
        knobs.append(["models.value.mode=shared"])
    if plan.largest == "update":
        budget = max(
            64, (cfg.ppo.micro_batch_tokens or cfg.ppo.minibatch_size * cfg.rollout.max_new_tokens) // 4
        )
        knobs.append([f"ppo.micro_batch_tokens={budget}", "ppo.micro_batch_size=null"])
    if plan.largest == "stored passes":
        rows = max(1, (cfg.rollout.forward_batch_size or cfg.rollout.batch_size) // 4)
        knobs.append([f"rollout.forward_batch_size={rows}"])
    ladder_saved = [(change, saving) for change in rungs if (saving := _saving(cfg, plan, change))]
    knob_saved = [(change, saving) for change in knobs if (saving := _saving(cfg, plan, change))]
    return [(" ".join(c), saving) for c, saving in [*ladder_saved, *sorted(knob_saved, key=lambda i: -i[1])]]


def remedy_list(cfg: Config, plan: MemoryPlan) -> str:
    """:func:`remedies` as the one line an error names them in."""
    return "; ".join(f"{change} (saves {size(saved)})" for change, saved in remedies(cfg, plan))


def _saving(cfg: Config, plan: MemoryPlan, overrides: list[str]) -> int:
    """Bytes per rank the plan loses with ``overrides`` applied; 0 when under 1 % (not worth naming) or
    when the changed config is refused (a rung this run cannot take)."""
    try:
        changed = load_config(base=cfg.model_dump(mode="json"), overrides=overrides)
        smaller = memory_plan(
            changed, world_size=plan.world_size, available=plan.available, device=plan.device
        )
    except LmppoError:
        return 0
    saved = plan.needed_per_rank - smaller.needed_per_rank
    return saved if saved > plan.needed_per_rank / 100 else 0


def check_plan(cfg: Config, spec: RunSpec, force: bool = False) -> MemoryPlan:
    """Refuse a run whose plan cannot fit the device (``lmppo ppo``), unless ``force``."""
    plan = memory_plan(cfg, spec=spec)
    if plan.fits or force:
        return plan
    fixes = remedy_list(cfg, plan)
    largest = max(plan.phases, key=plan.phases.get)
    raise LmppoError(
        f"this run needs about {size(plan.needed)} more memory on {plan.device} but {size(plan.available)} "
        f"are available (per rank: models {size(plan.static)}, largest phase {largest} "
        f"{size(plan.phases[largest])}; `lmppo plan CONFIG` shows the whole table). "
        + (f"To fit, change: {fixes}. " if fixes else "")
        + (
            "More ranks shrink it only under distributed.strategy=fsdp2 (under ddp each rank holds whole "
            "models). "
            if cfg.distributed.strategy == "ddp"
            else ""
        )
        + "Pass --force to start anyway."
    )


def count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def check_startable(cfg: Config) -> None:
    """What ``lmppo ppo`` refuses before it loads a model, besides memory: the batch sizes against the
    prompts (:func:`lmppo.inputs.resolve.check_batches`), so a plan that says "fits" is a run that starts."""
    check_batches(cfg, len(load_prompts(cfg.data.prompts, cfg.data.split, cfg.data.prompt_key)))


def plan_report(plan: MemoryPlan) -> Group:
    """The plan as the seeds' memory table, the step's phases and the verdict (per rank)."""
    sharded = any(row.shards > 1 for row in plan.models)
    models = Table(
        title=f"memory plan per rank: {plan.device}, {plan.precision}, {plan.world_size} rank(s)"
        + (", FSDP2 (each rank's shards)" if sharded else "")
    )
    columns = ["model", "params", "dtype", "trained", "weights", "grads+Adam", "total"]
    columns += ["host"] if plan.host else []  # offloaded weights and optimizer state
    for column in columns:
        models.add_column(column, justify="left" if column in ("model", "dtype") else "right")
    for row in plan.models:
        share = f"{row.trained / row.parameters:.1%}" if row.parameters else "-"
        shards = f"1/{row.shards}" if row.shards > 1 and row.parameters else ""
        note = ", ".join(filter(None, [row.note, shards]))
        name = f"{row.role} ({note})" if note else row.role
        models.add_row(
            name,
            count(row.parameters),
            row.dtype,
            share,
            size(row.weights),
            size(row.grads + row.adam),
            size(row.total),
            *([size(row.host)] if plan.host else []),
        )
    phases = Table(title="one step (the phases follow one another: the largest counts)")
    for column in ("phase", "memory", "sized by"):
        phases.add_column(column, justify="right" if column == "memory" else "left")
    largest = plan.largest
    for phase, nbytes in plan.phases.items():
        phases.add_row(f"{phase} (peak)" if phase == largest else phase, size(nbytes), plan.details[phase])
    lines = [
        f"peak per rank: [bold]{size(plan.peak)}[/] = models {size(plan.static)} + {largest} "
        f"{size(plan.phases[largest])}"
        + (f" + heap retention {size(plan.retained)}" if plan.retained else "")
        + f" + process {size(plan.runtime)}"
        + (" (the CUDA context, outside torch's max_memory_allocated)" if plan.device == "cuda" else "")
    ]
    if plan.host:
        lines.append(f"offloaded to host memory per rank: {size(plan.host)} (not in the device's peak)")
    if plan.available is not None:
        ranks = f" for {plan.ranks_per_device} ranks" if plan.ranks_per_device > 1 else ""
        verdict = "[green]fits[/]" if plan.fits else "[bold red]does NOT fit[/]"
        lines.append(
            f"{plan.device} has {size(plan.available)} available; the run needs {size(plan.needed)} more{ranks}: {verdict}"
        )
    return Group(models, phases, *lines)
