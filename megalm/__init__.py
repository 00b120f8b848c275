"""megalm: Megatron-style LLM pretraining in readable PyTorch."""

__version__ = "0.1.0"
