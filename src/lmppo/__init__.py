"""lmppo: PPO for RLHF on Hugging Face causal language models."""

import logging

from lmppo.version import __version__ as __version__  # re-exported: lmppo.__version__

# torchao (lmppo[quantize]) is imported by peft and transformers whenever it is installed, and logs on
# import every optional CUDA kernel library it cannot load here, as torch logs its enum registrations:
# nothing a user of lmppo can act on. Errors still pass.
for _logger in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_logger).setLevel(logging.ERROR)


def __getattr__(name: str):
    """``lmppo.train``: the Python API (:mod:`lmppo.interface.api`), imported when first used (it loads
    torch)."""
    if name in ("train", "TrainResult"):
        from lmppo.interface import api

        return getattr(api, name)
    raise AttributeError(f"module 'lmppo' has no attribute {name!r}")
