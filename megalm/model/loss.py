"""Per-token loss: a sum over tokens, normalised once by the token count of the whole global batch.

Averaging per micro-batch would weight a token by 1 / (tokens in its micro-batch), so the gradient
would depend on how the global batch is split over micro-batches, data-parallel ranks or CP shards.
Summing and dividing by the global count makes every split give the same gradient — the property
the parallel equivalence tests (and ByteScale HDP, where ranks run different numbers of micro-batches
of different lengths) rely on.

The cross entropy runs over chunks of tokens, forward and backward (as fused-cross-entropy kernels such as
Liger's do): the fp32 logits, their softmax and its gradient exist for one chunk at a time, never as [T, V] fp32
tensors of the whole micro-batch (824 MB each for 4,096 tokens at a 50k vocab) held from the forward to the
backward. What the loss keeps for the backward is the logits as the head produced them (bf16 under autocast) and
each token's log-sum-exp, as its max and the log of its sum of exponentials (8 bytes a token), so the backward's
softmax is exp(logit - lse), with no max or sum to recompute. In training (`TokenLoss`) the backward writes each
chunk's gradient over its logits, which the runners read no more (as Liger's fused cross entropy does), so the
step's peak, the start of the backward, holds one [T, V] tensor, not two (412 MB less for 4,096 tokens at a 50k
vocab in bf16).

A chunk's arithmetic is two functions, `chunk_statistics` and `chunk_logits_grad_`. `TokenLoss.compile` (what
`trainer.compile` does, as TorchTitan's `compile.components = ["loss"]`) compiles `chunk_statistics` and
`fused_chunk_logits_grad_` (the gradient written as one expression that inductor fuses): a kernel or two each that
read the bf16 logits and write the bf16 gradient in their place, where eager kernels write and re-read an fp32 copy
of each chunk (6 bytes an element for the forward and backward by inductor's count, against 47 eager:
tests/unit/test_compile_blocks.py, docs/benchmarks.md).

The chunks compute per-token statistics (max, log-sum of exponentials, the label's logit) and the loss is summed
from them, so that logits holding a slice of the vocabulary's columns take the same path: `combine` turns the
slice's statistics into the whole vocabulary's before the sum (megalm.parallel.tensor.loss all-reduces them over
TP ranks; this module has no collectives), and the backward's softmax needs nothing more.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

import torch

from megalm.compat import as_function_output

log = logging.getLogger("megalm")

CHUNK_BYTES = 256 * 2**20  # the fp32 logits of one chunk: a quarter GB whatever the vocab
ALIGNMENT = 16  # bytes: where inductor's GPU kernels assume their inputs start (else it copies them in and out)


def chunk_tokens_for(width: int, chunk_tokens: int | None = None) -> int:
    """Tokens per chunk of [T, width] logits: `chunk_tokens`, or as many as fit CHUNK_BYTES in fp32."""
    return chunk_tokens or max(1, CHUNK_BYTES // (4 * width))


def misaligned_chunks(logits: torch.Tensor, chunk_tokens: int | None = None) -> int:
    """How many of the loss's chunks of `logits` start off an ALIGNMENT-byte boundary: on a GPU, a compiled kernel
    copies such a chunk in and out (inductor's `copy_misaligned_inputs`), as it does when the columns' bytes are
    not a multiple of 16 (a padded vocab of 8·k columns in bf16 is one)."""
    width, size = logits.shape[-1], logits.element_size()
    starts = _chunks(logits.shape[0], chunk_tokens_for(width, chunk_tokens))
    return sum((logits.storage_offset() + part.start * width) * size % ALIGNMENT != 0 for part in starts)


def _chunks(total: int, chunk: int) -> list[slice]:
    return [slice(start, min(start + chunk, total)) for start in range(0, total, chunk)]


def chunk_statistics(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's per-token statistics in fp32 over its first `vocab_size` columns (later ones are padding: no
    probability mass): the row's max m_t, log s_t = log sum_v exp(logit_v - m_t), and the label's logit (0 where
    labels_t is -1: the label is in another rank's columns, under the vocab-parallel loss; -inf in the padding).

    The loss is lse_t - logit_t[label_t] with lse_t = m_t + log s_t, kept in two parts: apart, they give the
    backward's label entry p_t - 1 = expm1((logit_t - m_t) - log s_t) without cancelling logit_t against a rounded
    lse_t, whose last bit (2e-6 at lse ~ 20) is 10% of a confident prediction's gradient (F.cross_entropy's
    log_softmax subtracts the max first too)."""
    x = logits[:, :vocab_size]
    m = x.amax(dim=-1).float()  # the max of the logits as they are: exact, and a read of 2 bytes, not an fp32 copy's
    # fp32 (type promotion): on a GPU the cast is this kernel's read (the CPU's upcasts x into a temporary first)
    log_s = (x - m.unsqueeze(-1)).exp_().sum(dim=-1).log_()
    target = logits.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1).float()
    # a label in the padding (bad data) has no probability: an infinite loss on every rank, which the trainer's
    # non-finite check catches (an index error on one TP rank would leave the others waiting in the all-reduce)
    return m, log_s, torch.where(labels < 0, 0.0, torch.where(labels < vocab_size, target, float("-inf")))


def chunk_logits_grad_(logits: torch.Tensor, labels: torch.Tensor, m: torch.Tensor, log_s: torch.Tensor,
                       scale: torch.Tensor, vocab_size: int, out: torch.Tensor | None = None) -> None:
    """Write one chunk's d loss / d logits into `out` (None: over the logits themselves): scale_t * (softmax_v -
    [v == label_t]), 0 on the padding; a label of -1 (another rank's column) has no entry here.

    The bulk is scale_t * exp(logit - lse_t), rounded once into the logits' dtype; the label's entry is then
    overwritten by scale_t * expm1((logit_t - m_t) - log s_t), from the label logit gathered first, in fp32
    (`chunk_statistics`: subtracting 1 from a rounded p_t would lose the gradient of a confident prediction). Rows
    whose label is elsewhere rewrite their column 0 with its bulk value, up to one fp32 rounding (column 0 is never
    padding: a shard of padding only runs no kernel)."""
    out = logits if out is None else out
    on_rank, column = labels >= 0, labels.clamp(min=0).unsqueeze(-1)
    d_target = (logits.gather(-1, column).squeeze(-1).float() - m) - log_s
    p = logits[:, :vocab_size] - (m + log_s).unsqueeze(-1)  # fp32 (type promotion): the cast is this kernel's read
    if torch.compiler.is_compiling():  # dynamo takes no `out=` slice; a compiled graph fuses the two anyway
        out[:, :vocab_size].copy_(p.exp_().mul_(scale.unsqueeze(-1)))
    else:  # in fp32, rounded once as it is written: no fp32 product written and read again (a GPU's kernel; the
        # CPU's stages its bf16 output through a temporary, with the same values)
        torch.mul(p.exp_(), scale.unsqueeze(-1), out=out[:, :vocab_size])
    out[:, vocab_size:].zero_()
    label_entry = torch.where(on_rank, torch.expm1(d_target), torch.exp(d_target)).mul_(scale)
    out.scatter_(-1, column, label_entry.unsqueeze(-1).to(out.dtype))


def fused_chunk_logits_grad_(logits: torch.Tensor, labels: torch.Tensor, m: torch.Tensor, log_s: torch.Tensor,
                             scale: torch.Tensor, vocab_size: int, out: torch.Tensor | None = None) -> None:
    """`chunk_logits_grad_` as one pointwise expression, for torch.compile: inductor makes it one kernel that reads
    each logit and writes its gradient (in its place where `out` is None); the eager form's in-place ops and scatter
    would make it write and re-read fp32 copies. The same arithmetic up to fp32 roundings (the bulk subtracts m and
    log s one after the other, where the eager form subtracts their sum). Eager, its selects over [n, V] would cost
    twice the eager form's bytes."""
    cols = torch.arange(logits.shape[-1], device=logits.device)
    d = (logits - m.unsqueeze(-1)) - log_s.unsqueeze(-1)
    p = torch.where(cols == labels.unsqueeze(-1), torch.expm1(d), torch.exp(d)) * scale.unsqueeze(-1)
    (logits if out is None else out).copy_(torch.where(cols < vocab_size, p, 0))


class ChunkKernels(NamedTuple):
    """The two functions a chunk runs: `chunk_statistics`'s signature and `chunk_logits_grad_`'s (eager or
    compiled)."""

    statistics: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    logits_grad: Callable[..., None]


EAGER_KERNELS = ChunkKernels(chunk_statistics, chunk_logits_grad_)

Statistics = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def whole_vocab(m: torch.Tensor, log_s: torch.Tensor, target: torch.Tensor) -> Statistics:
    """The `combine` of logits that hold every column: their statistics are the whole vocabulary's."""
    return m, log_s, target


class _ChunkedTokenLossSum(torch.autograd.Function):
    """sum_t weight_t * (logsumexp(logits_t) - logits_t[label_t]), over chunks of tokens. `combine` turns the
    statistics of this tensor's columns into the whole vocabulary's (the identity for full logits; the
    vocab-parallel loss reduces them over TP ranks, megalm.parallel.tensor.loss); the backward needs none."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, vocab_size: int,
                chunk: int, kernels: ChunkKernels, overwrite_logits: bool, combine: Callable[..., Statistics]
                ) -> torch.Tensor:
        m, log_s, target = torch.zeros((3, logits.shape[0]), dtype=torch.float32, device=logits.device)
        if vocab_size == 0:  # a vocab-parallel shard of padding only: no mass here, and no label (`chunk_statistics`)
            m.fill_(float("-inf")), log_s.fill_(float("-inf")), target.masked_fill_(labels >= 0, float("-inf"))
        else:
            for part in _chunks(logits.shape[0], chunk):
                m[part], log_s[part], target[part] = kernels.statistics(logits[part], labels[part], vocab_size)
        m, log_s, target = combine(m, log_s, target)
        ctx.save_for_backward(logits, labels, weight, m, log_s)
        ctx.vocab_size, ctx.chunk, ctx.kernels, ctx.overwrite_logits = vocab_size, chunk, kernels, overwrite_logits
        return as_function_output((((m - target) + log_s) * weight).sum())  # a view: see as_function_output

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, labels, weight, m, log_s = ctx.saved_tensors
        grad_logits = logits if ctx.overwrite_logits else torch.empty_like(logits)
        if ctx.vocab_size == 0:
            return grad_logits.zero_(), None, None, None, None, None, None, None
        scale = weight * grad
        for part in _chunks(logits.shape[0], ctx.chunk):
            ctx.kernels.logits_grad(logits[part], labels[part], m[part], log_s[part], scale[part], ctx.vocab_size,
                                    None if ctx.overwrite_logits else grad_logits[part])
        return grad_logits, None, None, None, None, None, None, None


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
                   vocab_size: int | None = None, chunk_tokens: int | None = None,
                   kernels: ChunkKernels = EAGER_KERNELS, overwrite_logits: bool = False,
                   first_column: int = 0, combine: Callable[..., Statistics] = whole_vocab) -> torch.Tensor:
    """Sum of next-token cross entropy over the positions where `loss_mask` is 1, in fp32.

    `vocab_size`: the real vocab when `logits` has padding columns past it (they get no probability
    mass, and so no gradient). `chunk_tokens`: tokens per chunk; None: as many as fit CHUNK_BYTES in fp32.
    Labels equal to -100 are ignored, as by F.cross_entropy. `kernels`: what runs each chunk (`TokenLoss.compile`).
    `overwrite_logits`: the backward writes the gradient over the logits (for a caller that reads them no more: a
    [T, V] tensor less at the backward's start), else into a tensor of its own.
    `first_column`, `combine`: for logits that are a slice of the vocabulary's columns starting at id
    `first_column`: `combine(m, log_s, target)` returns the whole vocabulary's per-token statistics from the
    slice's (`chunk_statistics`; the vocab-parallel loss reduces them over its ranks).
    """
    width = logits.shape[-1]
    chunk = chunk_tokens_for(width, chunk_tokens)
    ignored = labels == -100
    weight = loss_mask.float().masked_fill(ignored, 0.0)
    vocab = width if vocab_size is None else min(max(vocab_size - first_column, 0), width)
    columns = labels.masked_fill(ignored, 0) - first_column
    if combine is not whole_vocab:  # -1: the label is another slice's (with every column, a bad label raises)
        columns = columns.masked_fill((columns < 0) | (columns >= width), -1)
    return _ChunkedTokenLossSum.apply(logits, columns, weight, vocab, chunk, kernels, overwrite_logits, combine)


class TokenLoss:
    """loss(logits, labels, loss_mask) -> `token_loss_sum` of full-vocab logits [T, V]: the loss a model with one
    tensor-parallel rank trains with. The runners read the logits no more once the loss has them, so its backward
    writes their gradient over them (`overwrite_logits`): the logits passed in hold the gradient after the backward,
    and a second backward through them (retain_graph) or any op that saved them raises autograd's in-place error.
    `compile(backend)` compiles its chunk kernels (trainer.compile). For logits that are a slice of the vocabulary's
    columns, a subclass gives the slice's `first_column` and the `combine` of its statistics
    (megalm.parallel.tensor.loss.VocabParallelTokenLoss)."""

    combine: Callable[..., Statistics] = staticmethod(whole_vocab)

    def __init__(self, vocab_size: int | None = None, chunk_tokens: int | None = None) -> None:
        self.vocab_size, self.chunk_tokens = vocab_size, chunk_tokens
        self.kernels = EAGER_KERNELS
        self._alignment_checked = False

    def first_column(self, logits: torch.Tensor) -> int:
        """The vocabulary id of the logits' first column: 0, they hold every column."""
        return 0

    def compile(self, backend: str | Callable = "inductor") -> None:
        """torch.compile the chunk kernels with `backend`. Chunks have one shape but the last: at most four graphs
        each, the chunk's, a dynamic token count's (from the first ragged chunk on), and two of a one-token chunk
        (dynamo specialises sizes and offsets of 0 and 1: a one-token micro-batch, and a last chunk of one token; HDP's
        filler micro-batches are one token)."""
        self.kernels = ChunkKernels(torch.compile(chunk_statistics, backend=backend),
                                    torch.compile(fused_chunk_logits_grad_, backend=backend))

    def check_alignment(self, logits: torch.Tensor) -> None:
        """Once, compiled on a GPU: one log line if the chunks of these logits are copied in and out of the compiled
        kernels (`misaligned_chunks`): a slower path than asked for."""
        if self._alignment_checked or self.kernels is EAGER_KERNELS or logits.device.type == "cpu":
            return
        self._alignment_checked = True
        if misaligned := misaligned_chunks(logits, self.chunk_tokens):
            log.warning("trainer.compile: %d of the loss's chunks of logits %d columns wide start off a %d-byte "
                        "boundary, so inductor copies each in and out of its kernels; pad the vocabulary to a "
                        "multiple of 8 columns a rank (model.make_vocab_size_divisible_by, default 128)", misaligned,
                        logits.shape[-1], ALIGNMENT)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        self.check_alignment(logits)
        return token_loss_sum(logits, labels, loss_mask, self.vocab_size, self.chunk_tokens, self.kernels,
                              overwrite_logits=True, first_column=self.first_column(logits), combine=self.combine)
