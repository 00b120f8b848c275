"""The GPT model definition (no collectives: parallelism is applied from outside, see megalm/parallel)."""

from megalm.model.attention import Attention, select_attention_backend, varlen_attention
from megalm.model.gpt import GPT, TransformerBlock, init_weights, initial_value, num_parameters

__all__ = [
    "GPT",
    "Attention",
    "TransformerBlock",
    "init_weights",
    "initial_value",
    "num_parameters",
    "select_attention_backend",
    "varlen_attention",
]
