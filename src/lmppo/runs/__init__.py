"""A whole run: built from its spec (:mod:`~lmppo.runs.build`) after its memory plan
(:mod:`~lmppo.runs.plan`), stepped, evaluated (:mod:`~lmppo.runs.evaluate`, the reward pre-flight
:mod:`~lmppo.runs.preflight`), judged (:mod:`~lmppo.runs.failure_modes`, :mod:`~lmppo.runs.guards`,
:mod:`~lmppo.runs.diagnose`), checkpointed and resumed (:mod:`~lmppo.runs.checkpoint`,
:mod:`~lmppo.runs.trainer_state`) and reported (:mod:`~lmppo.runs.report`); :mod:`~lmppo.runs.run` holds the loop.

May import: the basics, :mod:`lmppo.math`, :mod:`lmppo.inputs`, :mod:`lmppo.modeling`, :mod:`lmppo.sampling`,
:mod:`lmppo.rewards`, :mod:`lmppo.training`."""
