"""One response per prompt (:class:`ResponseGenerator`), on any engine: prompts rendered and left-padded,
the engine's samples cut at their first stop token (:func:`~lmppo.sampling.rollout.response_mask_from_ids`),
termination and the texts a user reads, into a :class:`~lmppo.sampling.rollout.Rollout`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from lmppo.inputs.data import Prompt
from lmppo.math.core import last_response_index
from lmppo.sampling.engines import Engine, OnEngine
from lmppo.sampling.prompts import PromptRenderer
from lmppo.sampling.rollout import Rollout, response_mask_from_ids


class ResponseGenerator(OnEngine):
    """A :class:`~lmppo.sampling.engines.Generator` sampling one response per prompt on ``engine``."""

    def __init__(self, engine: Engine, renderer: PromptRenderer) -> None:
        self.engine, self.renderer = engine, renderer

    def generate(
        self,
        prompts: Sequence[Prompt],
        policy_version: int,
        sample_ids: Sequence[int] | None = None,
        rows: Sequence[dict] | None = None,
    ) -> Rollout:
        """Sample one response per prompt (``rows`` unused: no environment); ``logp_old`` is recorded while
        sampling."""
        engine = self.engine
        query_ids, query_mask = (t.to(engine.device) for t in self.renderer.query_batch(prompts))
        sample_ids = list(range(len(prompts))) if sample_ids is None else list(sample_ids)
        response_ids, logp_old, values = engine.sample(query_ids, query_mask, sample_ids)
        engine.sleep()  # the update needs the memory
        response_mask, terminated = response_mask_from_ids(response_ids, engine.settings.stop_token_ids)
        estimates = {}
        if values is not None:  # (B, R' + 1): V before each response token, then after the last column
            after_last = values.gather(1, (last_response_index(response_mask) + 1).unsqueeze(1)).squeeze(1)
            estimates = {
                "values": values[:, :-1].clone(),
                "bootstrap_value": torch.where(terminated, 0.0, after_last),
            }
        lengths = response_mask.sum(dim=1).long() - terminated.long()  # the stop token is not shown
        return Rollout(
            query_ids=query_ids,
            query_mask=query_mask,
            response_ids=response_ids,
            response_mask=response_mask,
            terminated=terminated,
            logp_old=logp_old,
            policy_version=engine.version_sampled(policy_version),
            created_at=time.time(),
            prompts=list(prompts),
            response_texts=self.renderer.response_texts(response_ids, lengths),
            temperature=engine.settings.temperature,
            **estimates,
        )
