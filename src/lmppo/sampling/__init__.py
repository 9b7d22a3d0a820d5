"""Rollouts: the records of a batch of responses and how they are cut (:mod:`~lmppo.sampling.rollout`), the
passes over them (:mod:`~lmppo.sampling.passes`), and the engines that sample them behind one protocol
(:mod:`~lmppo.sampling.engines`; transformers: :mod:`~lmppo.sampling.hf_engine`, vLLM:
:mod:`~lmppo.sampling.vllm_engine`).

May import: the basics, :mod:`lmppo.math`, :mod:`lmppo.inputs`, :mod:`lmppo.modeling`."""
