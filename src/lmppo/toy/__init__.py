"""The embedded toy world: a small instruction task with a hidden gold judge, tokenizers, tiny Llamas.

`build_toy_world` writes an untrained policy, the reward tokenizer and the data sets to a directory;
`gold_score` is the judge that evaluation (never training) may consult. See docs/toy_world.md.

May import: the other basics (:mod:`lmppo.errors`).
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
