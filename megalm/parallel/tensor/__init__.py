"""Tensor (+ sequence) parallelism: comm.py (conjugate collectives), layers.py (sharded layers),
loss.py (vocab-parallel cross entropy), apply.py (sharding a GPT from outside, the TP shape rules)."""

from megalm.parallel.tensor.apply import (
    apply_tensor_parallel,
    check_tensor_parallel,
    loss_fn_for,
    tp_grad_norm_squared,
    tp_norm_share,
)
from megalm.parallel.tensor.comm import (
    copy_to_tp,
    gather_from_sp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    split_to_sp,
    sum_grad_over_sharers,
    sync_grad_over_tp,
)
from megalm.parallel.tensor.layers import ColumnParallelLinear, ParallelNorm, RowParallelLinear, VocabParallelEmbedding
from megalm.parallel.tensor.loss import VocabParallelTokenLoss, vocab_parallel_token_loss_sum

__all__ = [
    "ColumnParallelLinear", "ParallelNorm", "RowParallelLinear", "VocabParallelEmbedding", "VocabParallelTokenLoss",
    "apply_tensor_parallel",
    "check_tensor_parallel", "copy_to_tp", "gather_from_sp", "loss_fn_for", "reduce_from_tp", "reduce_scatter_to_sp",
    "split_to_sp", "sum_grad_over_sharers", "sync_grad_over_tp", "tp_grad_norm_squared", "tp_norm_share",
    "vocab_parallel_token_loss_sum",
]
