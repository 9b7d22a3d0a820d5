"""lmppo: PPO for RLHF on Hugging Face causal language models."""

__version__ = "0.1.0"
