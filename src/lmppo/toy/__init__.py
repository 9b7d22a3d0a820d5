"""The embedded toy world: a small instruction task with a hidden gold judge, tokenizers, tiny Llamas.

`build_toy_world` writes an untrained policy, the reward tokenizer and the data sets to a directory;
`gold_score` is the judge that evaluation (never training) may consult. The tools task
(:mod:`lmppo.toy.tools`, ``lmppo quickstart --task tools``) adds a calculator environment for multi-turn
episodes. See docs/toy_world.md.

May import: the basics and :mod:`lmppo.sampling` (the calculator is a ``ToolEnvironment``).
"""

from lmppo.toy.models import ToyWorld, build_policy, build_toy_world, reward_model_from_policy
from lmppo.toy.task import gold_score, toy_datasets

__all__ = [
    "ToyWorld",
    "build_policy",
    "build_toy_world",
    "gold_score",
    "reward_model_from_policy",
    "toy_datasets",
]
