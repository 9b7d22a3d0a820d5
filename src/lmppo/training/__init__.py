"""The training steps: PPO's (:mod:`~lmppo.training.trainer`, its estimator
:mod:`~lmppo.training.advantages`), best-of-n's (:mod:`~lmppo.training.best_of_n`), what both share
(:mod:`~lmppo.training.base`, composing the sampler :mod:`~lmppo.training.sampler` and the scorer
:mod:`~lmppo.training.scorer`), their typed results and metrics (:mod:`~lmppo.training.step_results`,
:mod:`~lmppo.training.metrics`), and the supervised stages: SFT (:mod:`~lmppo.training.sft`) and reward-model
training (:mod:`~lmppo.training.reward_modeling`).

May import: the basics, :mod:`lmppo.math`, :mod:`lmppo.inputs`, :mod:`lmppo.modeling`, :mod:`lmppo.sampling`,
:mod:`lmppo.rewards`."""
