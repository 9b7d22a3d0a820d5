"""Samples from the tests' tiny policy, and independent checks of their log-probs (shared by
test_rollout, test_passes and test_hf_engine)."""

from __future__ import annotations

import torch

from lmppo.sampling.hf_engine import hf_generator
from lmppo.sampling.rollout import (
    Rollout,
)

LOGP_TOL = 1e-4  # fp32: KV-cached sampling vs one teacher-forced pass differ by ~1e-6


PROMPTS = [
    "tell me a short story about the cat",
    "good",
    [  # multi-turn: with pad == EOS the prompt itself holds pad-id tokens that must stay attended
        {"role": "user", "content": "write a poem"},
        {"role": "assistant", "content": "red sun"},
        {"role": "user", "content": "one more about the dog"},
    ],
    "sad day",
]


def stop_ids(tokenizer) -> list[int]:
    return [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|end|>")]


def generate(model, tokenizer, *, seed=0, prompts=PROMPTS, **kwargs) -> Rollout:
    kwargs.setdefault("max_new_tokens", 10)
    kwargs.setdefault("stop_token_ids", stop_ids(tokenizer))
    torch.manual_seed(seed)
    return hf_generator(model, tokenizer, **kwargs).generate(prompts, policy_version=7)


def unpadded(rollout: Rollout, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row b's real prompt ids and its counted response ids, without any padding."""
    query = rollout.query_ids[b][rollout.query_mask[b].bool()]
    response = rollout.response_ids[b][rollout.response_mask[b].bool()]
    return query, response


def teacher_forced_logprobs(model, rollout: Rollout, b: int, temperature: float) -> torch.Tensor:
    """Independent check: one unpadded row, default positions, full logits, sliced by hand."""
    query, response = unpadded(rollout, b)
    with torch.no_grad():
        logits = model(input_ids=torch.cat([query, response])[None]).logits[0]
    predicting = logits[len(query) - 1 : len(query) + len(response) - 1] / temperature
    return torch.log_softmax(predicting, dim=-1).gather(1, response[:, None]).squeeze(1)
