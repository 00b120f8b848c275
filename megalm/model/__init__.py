"""The GPT model definition (no collectives: parallelism is applied from outside, see megalm/parallel)."""

from megalm.model.attention import Attention, choose_attention_backends, select_attention_backend, varlen_attention
from megalm.model.gpt import GPT, TransformerBlock, init_weights, initial_value, num_parameters

__all__ = [
    "GPT",
    "Attention",
    "TransformerBlock",
    "choose_attention_backends",
    "init_weights",
    "initial_value",
    "num_parameters",
    "select_attention_backend",
    "varlen_attention",
]
