"""The advantage estimators ``ppo.advantage`` names, one row each, and the record a run resolves them to.

A row says what an estimator needs (a critic; whole groups of samples per prompt) and what it does with a
scored rollout (which group baseline it subtracts, whether ``ppo.whiten_advantages`` applies). The config
takes its names from :data:`ESTIMATORS`, :func:`lmppo.inputs.resolve.resolve` settles the chosen row with the
config into ``RunSpec.estimator`` (:class:`EstimatorSpec`), and :mod:`lmppo.training.advantages` computes it
with :mod:`lmppo.math.core`'s math. Adding an estimator is a row here, its math in core when it is new, and a
test.

This module imports no torch: the config reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lmppo.math.core import GroupBaseline


@dataclass(frozen=True)
class Estimator:
    """What one estimator needs and does (formulas: docs/core.md)."""

    critic: bool  # GAE over a value model's values; else the reward-to-go itself, and no value model at all
    group_baseline: (
        GroupBaseline | None
    )  # the score minus its prompt's group statistic (core.group_advantages)
    whitens: bool  # ppo.whiten_advantages applies; a group baseline has put the score on its group's scale
    about: str  # what it is, for the config's description

    @property
    def groups(self) -> bool:
        """It compares the samples of one prompt: it needs rollout.samples_per_prompt >= 2."""
        return self.group_baseline is not None


ESTIMATORS: dict[str, Estimator] = {
    "gae": Estimator(True, None, True, "a critic's values and GAE"),
    "grpo": Estimator(False, "mean_std", False, "the group's mean and std as baseline (GRPO)"),
    "dr_grpo": Estimator(False, "mean", False, "the group's mean only (Dr. GRPO)"),
    "rloo": Estimator(False, "leave_one_out", False, "the mean of the prompt's other samples (RLOO)"),
    "reinforce_pp": Estimator(False, None, True, "REINFORCE++'s KL-shaped returns whitened over the batch"),
    "reinforce_pp_baseline": Estimator(
        False,
        "mean",
        True,
        "REINFORCE++ on the score minus its group's mean (the group's mean, the batch's std)",
    ),
}


@dataclass(frozen=True)
class EstimatorSpec:
    """The run's estimator with the config's settings that shape it, decided once (``RunSpec.estimator``)."""

    name: str  # ppo.advantage
    critic: bool  # a trained value model (a critic estimator under run.algorithm=ppo)
    group_baseline: GroupBaseline | None
    group_size: int  # rollout.samples_per_prompt: consecutive rows of one prompt
    whiten: bool  # the advantages to mean 0, std 1 over the whole batch
    kl_in_loss: bool  # kl.in_loss: the update's loss carries the KL to the reference, the reward does not
    bootstrap_truncated: bool  # rollout.truncation=bootstrap: a truncated row is unfinished, its future is V
    lam_policy: float | None  # the advantages' GAE lambda; None: VAPO's length-adaptive one per row
    lam_critic: float  # the returns' lambda (VC-PPO decouples it)
    lam_alpha: float  # the length-adaptive lambda's alpha
    gamma: float  # ppo.gamma: the discount over response tokens
    kl_estimator: str  # kl.estimator: the per-token estimate of KL(sampler || reference) (k1, k2, k3)

    @property
    def groups(self) -> bool:
        return self.group_baseline is not None
