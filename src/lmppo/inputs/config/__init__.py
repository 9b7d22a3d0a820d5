"""Run configuration: every setting of the project and its default, as pydantic sections, and the loading
that reads them from YAML and ``a.b=c`` overrides.

Unknown keys are errors that name the key they most likely mean (also for other trainers' names:
``learning_rate`` -> ``ppo.lr``); impossible values say what is allowed; each problem names the override or
file it came from. ``load_config(path, overrides)`` is the one entry point. The sections live by what they
configure (:mod:`.models`, :mod:`.reward`, :mod:`.rollout`, :mod:`.ppo`, :mod:`.run`), the whole configs in
:mod:`.schema`, the loading in :mod:`.loading` and the keys' paths, defaults and hints in :mod:`.keys`; every
name is imported from here.
"""

from lmppo.inputs.config.keys import NO_DEFAULT, OTHER_TRAINERS_KEYS, schema_default, section_of
from lmppo.inputs.config.loading import apply_override, load_config, read_yaml, validate_config
from lmppo.inputs.config.models import LoraConfig, ModelsConfig, ModelSource, ValueConfig
from lmppo.inputs.config.ppo import Advantage, BestOfNConfig, KLConfig, PPOConfig
from lmppo.inputs.config.reward import (
    SOURCE_KEYS,
    RewardComponent,
    RewardConfig,
    RewardGate,
    RewardSource,
    check_reward_url,
)
from lmppo.inputs.config.rollout import DataConfig, RolloutConfig
from lmppo.inputs.config.run import DiagnosisConfig, DistributedConfig, GuardsConfig, LoggingConfig, RunConfig
from lmppo.inputs.config.schema import Config, QuickstartConfig, SupervisedConfig, TrainingStage
from lmppo.inputs.config.section import Dtype, Section

__all__ = [
    "NO_DEFAULT",
    "OTHER_TRAINERS_KEYS",
    "SOURCE_KEYS",
    "Advantage",
    "BestOfNConfig",
    "Config",
    "DataConfig",
    "DiagnosisConfig",
    "DistributedConfig",
    "Dtype",
    "GuardsConfig",
    "KLConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelSource",
    "ModelsConfig",
    "PPOConfig",
    "QuickstartConfig",
    "RewardComponent",
    "RewardConfig",
    "RewardGate",
    "RewardSource",
    "RolloutConfig",
    "RunConfig",
    "Section",
    "SupervisedConfig",
    "TrainingStage",
    "ValueConfig",
    "apply_override",
    "check_reward_url",
    "load_config",
    "read_yaml",
    "schema_default",
    "section_of",
    "validate_config",
]
