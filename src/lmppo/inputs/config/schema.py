"""The configs a command validates whole: a PPO (or best-of-n) run's :class:`Config`, a supervised
stage's (``lmppo sft``, ``lmppo train-rm``) and the quickstart's. A section checks its own keys; the checks
that need more than one section are :mod:`lmppo.inputs.resolve`'s."""

from __future__ import annotations

import yaml
from pydantic import Field, model_validator

from lmppo.inputs.config.models import LoraConfig, ModelsConfig, ModelSource
from lmppo.inputs.config.ppo import BestOfNConfig, KLConfig, PPOConfig
from lmppo.inputs.config.reward import RewardConfig
from lmppo.inputs.config.rollout import DataConfig, RolloutConfig
from lmppo.inputs.config.run import DiagnosisConfig, DistributedConfig, GuardsConfig, LoggingConfig, RunConfig
from lmppo.inputs.config.section import Section


class Config(Section):
    """A PPO (or best-of-n) run: its sections in the order a config file lists them. Each section checks
    its own keys; :func:`lmppo.inputs.resolve.resolve` checks them against each other."""

    models: ModelsConfig
    reward: RewardConfig = RewardConfig()  # none: rollout.environment's turn rewards are the whole reward
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
    tools: list[str] = Field(
        [],
        description="sft: the PPO run's rollout.tools, their schemas rendered into every demonstration as the "
        "run renders its prompts",
    )

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
