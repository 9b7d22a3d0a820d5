"""The vLLM engine on SmolLM2-135M-Instruct (pad == EOS == <|im_end|>); runs in .venv-vllm (`make test-vllm`)."""

import gc

import pytest
import torch
from test_smollm2 import CACHE_DIR, PROMPTS, assert_masks_around_im_end, smollm2_gguf

from lmppo.math.core import token_logprobs
from lmppo.modeling.loading import cache_gguf_as_transformers, load_causal_lm, load_tokenizer
from lmppo.sampling.passes import response_logits

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_engine_on_smollm2_stops_at_im_end_and_matches_the_trainer():
    pytest.importorskip("vllm")
    from lmppo.sampling.vllm_engine import vllm_generator

    directory = cache_gguf_as_transformers(smollm2_gguf(), CACHE_DIR)
    policy, tokenizer = load_causal_lm(directory), load_tokenizer(directory)
    generator = vllm_generator(policy, tokenizer, directory, max_new_tokens=16, temperature=0.7, seed=0)
    try:
        rollout = generator.generate(PROMPTS, policy_version=0)
    finally:
        del generator.engine.llm
        gc.collect()
    assert rollout.terminated.any() and not rollout.terminated.all()  # short answers stop, the story is cut
    assert_masks_around_im_end(rollout, tokenizer, max_new_tokens=16)
    with torch.no_grad():
        teacher = token_logprobs(response_logits(policy, rollout), rollout.response_ids)
    gap = (teacher - rollout.logp_old)[rollout.response_mask.bool()].abs().max().item()
    print(f"SmolLM2 on vLLM: max |logp_old - teacher-forced| = {gap:.2e}")
    assert gap < 1e-4
