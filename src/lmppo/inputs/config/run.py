"""Around the steps: the run itself (``run``: length, device, numerics, checkpoints, evaluation), its ranks
(``distributed``), the rules that stop it (``guards``) or warn (``diagnosis``), and where its metrics go
(``logging``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from lmppo.inputs.config.section import Section


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
