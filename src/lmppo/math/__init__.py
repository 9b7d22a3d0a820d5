"""The math: PPO's tensor formulas (:mod:`~lmppo.math.core`: masked statistics, KL estimators, shaped
rewards, GAE, group baselines, the clipped losses, KL controllers) and the table of advantage estimators
(:mod:`~lmppo.math.estimators`). Pure functions on tensors, each tested against an independent oracle.

May import: nothing of lmppo but the basics (:mod:`lmppo.errors`)."""
