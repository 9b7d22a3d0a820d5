"""A randomly initialised ~1B-parameter Llama (no download): SmolLM2's tokenizer and chat template on a
Llama-3.2-1B-shaped stack (16 layers, hidden 2048, GQA 32/8 heads, MLP 8192, tied embeddings).

    python benchmarks/make_llama_1b.py .cache/lmppo/llama-1b                 # config, tokenizer, weights
    python benchmarks/make_llama_1b.py .cache/lmppo/llama-1b --config-only   # enough for `lmppo plan`

Random weights make nonsense text, but every shape, byte and FLOP is a real 1B model's: what the memory
plan and the GPU benchmark (benchmarks/gpu_check.sh) measure.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--config-only", action="store_true", help="write no weights (4 GiB in fp32)")
    args = parser.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lmppo.models import cache_gguf_as_transformers, load_tokenizer

    sys.path.insert(0, str(ROOT / "tests"))
    from test_smollm2 import CACHE_DIR, smollm2_gguf

    tokenizer = load_tokenizer(cache_gguf_as_transformers(smollm2_gguf(), CACHE_DIR))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(args.out)
    if args.config_only:
        config.save_pretrained(args.out)
    else:
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(args.out)
    print(args.out)


if __name__ == "__main__":
    main()
