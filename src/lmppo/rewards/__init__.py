"""Sequence rewards: a reward model on its own tokenizer and template, a Python function, several components
weighted and gated (:mod:`~lmppo.rewards.scoring`), a reward server's URL
(:mod:`~lmppo.rewards.remote_reward`) and the server itself, ``lmppo serve-rm``
(:mod:`~lmppo.rewards.reward_server`).

May import: the basics, :mod:`lmppo.math`, :mod:`lmppo.inputs`, :mod:`lmppo.modeling`,
:mod:`lmppo.sampling`."""
