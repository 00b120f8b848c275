"""Causal self-attention on packed variable-length documents, with interchangeable backends.

Hidden states are [T, hidden]: the documents of a micro-batch are packed into one stream and
`cu_seqlens` [N + 1] holds their start offsets. Attention is causal inside each document and never
crosses a boundary, i.e. a block-diagonal causal mask. softmax(q k^T / sqrt(D)) v (Vaswani et al.
2017) with grouped-query attention (GQA, Ainslie et al. 2023): query head h reads kv head
h // (Hq / Hkv), the convention flash-attn and torch SDPA share.

Backends compute the same function and differ only in speed and where they run:
  flash_attn    flash-attn's varlen kernel (CUDA, fp16/bf16, sm80+)
  torch_varlen  torch.nn.attention.varlen.varlen_attn (CUDA, fp16/bf16, sm80+; no dropout)
  cudnn         (CUDA, fp16/bf16, sm80+; no dropout) a micro-batch whose documents all have one length is one
                batched torch SDPA call, where torch runs cuDNN's attention kernel on Hopper and Blackwell with
                cuDNN > 9.15 (its own rule; flash elsewhere); the others run torch_varlen (whose cuDNN path torch
                keeps off). Hugging Face measured cuDNN's kernel 1.7-2.3x torch's flash kernel on H100 in training
                shapes and slower on other GPUs (transformers PR 48163), and TorchTitan runs SDPA cuDNN first, so
                auto picks it on sm90; tools/bench/attention_kernels.py measures both on the GPU at hand.
  sdpa          torch SDPA: one batched call when all documents have the same length, else one per
                document. Runs anywhere; the CPU path.
  reference     explicit fp32 math with a [T, T] mask; the oracle for tests (O(T^2) memory).
"""

from __future__ import annotations

import functools
import logging
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from megalm import compat
from megalm.config import ModelConfig
from megalm.config.choices import AttentionBackend
from megalm.errors import ConfigError
from megalm.model.document_sdpa import batched_sdpa, equal_documents, per_document_sdpa
from megalm.model.linear import Linear
from megalm.model.norm import RMSNorm
from megalm.model.rope import apply_rope

logger = logging.getLogger(__name__)

BACKENDS = AttentionBackend.names()
_FAST_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _flash_attn_importable() -> bool:
    try:
        import flash_attn  # noqa: F401
    except Exception:  # ImportError, or an OSError/RuntimeError from a build that does not match torch
        return False
    return True


def _flash_capable(device: torch.device, dtype: torch.dtype) -> bool:
    """A CUDA device of compute capability 8.0+ (what flash kernels need) and a half-precision dtype."""
    capability = compat.cuda_capability(device)
    return dtype in _FAST_DTYPES and capability is not None and capability >= (8, 0)


def _hopper(device: torch.device) -> bool:
    """An sm90 device (H100, H200): where cuDNN's attention is reported to beat flash (module docstring)."""
    capability = compat.cuda_capability(device)
    return capability is not None and capability[0] == 9


@compat.constant_to_dynamo  # called inside compiled blocks (context parallelism): a constant, not traced
def select_attention_backend(
    requested: str, device: torch.device | str, dtype: torch.dtype, *, dropout: bool = False, window: bool = False
) -> str:
    """The backend to run for q of this device/dtype; "auto" picks the fastest that can run.

    auto on CUDA in fp16/bf16: cudnn on sm90 (its unequal micro-batches and ring blocks run torch's own
    FlashAttention-2 kernel, not the flash-attn package's), else flash_attn if importable, else torch_varlen; else
    sdpa. `dropout=True` (attention dropout active) rules out torch_varlen and cudnn, which have no dropout;
    `window=True` (a sliding window) rules them out on a torch whose varlen kernel takes no window (< 2.11). An
    explicit backend that cannot run raises ConfigError naming the fix.
    """
    device = torch.device(device)
    fast = _flash_capable(device, dtype)
    can_flash = fast and _flash_attn_importable()
    can_varlen = fast and compat.varlen_attn_available() and not dropout and (
        not window or compat.varlen_window_available())
    can_cudnn = can_varlen and torch.backends.cuda.cudnn_sdp_enabled()  # not switched off by the user
    where = f"(got {device.type} {str(dtype).removeprefix('torch.')})"
    if requested == "auto":
        if can_cudnn and _hopper(device):
            return "cudnn"
        return "flash_attn" if can_flash else "torch_varlen" if can_varlen else "sdpa"
    if requested in ("cudnn", "torch_varlen") and window and fast and not compat.varlen_window_available():
        raise ConfigError(f"model.attention_backend={requested} with model.sliding_window needs torch >= 2.11's "
                          "varlen kernel (window_size); use model.attention_backend=auto")
    if requested == "cudnn" and not can_cudnn:
        if dropout and fast:
            raise ConfigError("model.attention_backend=cudnn runs torch_varlen on micro-batches of unequal documents, "
                              "which has no attention dropout; set model.attention_dropout=0 or use "
                              "model.attention_backend=auto")
        if can_varlen:
            raise ConfigError("model.attention_backend=cudnn needs torch SDPA's cuDNN kernel, switched off by "
                              "torch.backends.cuda.enable_cudnn_sdp(False); use model.attention_backend=auto")
        raise ConfigError("model.attention_backend=cudnn needs a CUDA device (sm80+) in fp16/bf16 and "
                          f"torch.nn.attention.varlen (torch >= 2.10) {where}; use model.attention_backend=auto")
    if requested == "flash_attn" and not can_flash:
        raise ConfigError("model.attention_backend=flash_attn needs the flash-attn package and a CUDA device "
                          f"(sm80+) in fp16/bf16 {where}; use model.attention_backend=auto")
    if requested == "torch_varlen" and not can_varlen:
        if dropout and fast:
            raise ConfigError("model.attention_backend=torch_varlen has no attention dropout; set "
                              "model.attention_dropout=0 or use model.attention_backend=auto")
        raise ConfigError("model.attention_backend=torch_varlen needs torch.nn.attention.varlen and a CUDA "
                          f"device (sm80+) in fp16/bf16 {where}; use model.attention_backend=auto")
    if requested not in BACKENDS:
        raise ConfigError(f"model.attention_backend={requested} is not one of {'|'.join(BACKENDS)}; "
                          "use model.attention_backend=auto")
    return requested


def one_kernel_backend(requested: str, device: torch.device | str, dtype: torch.dtype, *, dropout: bool = False
                       ) -> str:
    """`requested`, but where it is auto and resolves to cudnn for q of this device, dtype and dropout, torch_varlen:
    one kernel for documents of every length (cudnn runs equal ones with another). For measurements that must time
    one kernel throughout: the HDP calibration (its design points are mostly equal documents, HDP trains packed
    ragged ones and ring blocks), and context parallelism (cp 1 runs a whole document, the ring blocks of it)."""
    if requested == "auto" and select_attention_backend(requested, device, dtype, dropout=dropout) == "cudnn":
        return "torch_varlen"
    return requested


@functools.cache
def _resolve_backend(requested: str, device: torch.device, dtype: torch.dtype, dropout: bool,
                     window: bool = False) -> str:
    """`select_attention_backend`, cached per (device, dtype, dropout, window) and logged once for each."""
    backend = select_attention_backend(requested, device, dtype, dropout=dropout, window=window)
    logger.info("attention backend: %s (model.attention_backend=%s, %s, %s%s)", backend, requested,
                device, str(dtype).removeprefix("torch."), ", a sliding window" if window else "")
    return backend


def reference_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    dropout_p: float = 0.0,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Explicit fp32 attention with a block-diagonal causal [T, T] mask built from `cu_seqlens` (each query within
    its last `window` keys, itself included, where a window is set)."""
    total, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    scale = head_dim**-0.5 if scale is None else scale
    qf = q.float().transpose(0, 1)  # [H, T, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (qf @ kf.transpose(1, 2)) * scale  # [H, T, T]

    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=q.device), lengths, output_size=total)
    pos = torch.arange(total, device=q.device)
    allowed = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])
    if window is not None:
        allowed &= pos[:, None] - pos[None, :] < window
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    return (probs @ vf).transpose(0, 1).to(q.dtype)


def _sdpa_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float,
    scale: float | None,
    window: int | None = None,
) -> torch.Tensor:
    if equal_documents(q, cu_seqlens, max_seqlen):
        return batched_sdpa(q, k, v, cu_seqlens, max_seqlen, dropout_p, scale, window)
    if torch.compiler.is_compiling():  # the loop left out of the graph (imported here: it imports torch._dynamo)
        from megalm.model.eager_attention import per_document_sdpa_outside_graphs as loop
    else:
        loop = per_document_sdpa
    return loop(q, k, v, cu_seqlens, dropout_p, scale, window)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    backend: str,
    dropout_p: float = 0.0,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention within each packed document: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D].

    `cu_seqlens` int32 [N + 1] are document offsets (cu_seqlens[-1] == T), `max_seqlen` the longest
    document; `backend` one of flash_attn | torch_varlen | cudnn | sdpa | reference (not "auto"); `window`: each
    query attends to its last `window` keys, itself included (None: all of its document's before it).
    """
    if window is not None and window >= max_seqlen:
        window = None  # no document is longer: the same attention, and the kernels' causal case
    if backend == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        cu = cu_seqlens.to(torch.int32)
        return flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, dropout_p=dropout_p,
                                      softmax_scale=scale, causal=True,
                                      window_size=(-1, -1) if window is None else (window - 1, 0))
    if backend in ("torch_varlen", "cudnn"):
        if dropout_p > 0.0:
            raise ValueError(f"the {backend} attention backend has no dropout")
        if backend == "cudnn" and window is None and equal_documents(q, cu_seqlens, max_seqlen):
            return batched_sdpa(q, k, v, cu_seqlens, max_seqlen, 0.0, scale)
        return compat.varlen_attn(q, k, v, cu_seqlens.to(torch.int32), max_seqlen, scale=scale, window=window)
    if backend == "sdpa":
        return _sdpa_varlen_attention(q, k, v, cu_seqlens, max_seqlen, dropout_p, scale, window)
    if backend == "reference":
        return reference_varlen_attention(q, k, v, cu_seqlens, dropout_p, scale, window)
    raise ValueError(f"unknown attention backend {backend!r}")


class AttentionContext(Protocol):
    """How attention runs for one micro-batch when its documents are spread over several ranks.

    A micro-batch may carry one (context parallelism, HDP rings: megalm/parallel/context/attention.py);
    every attention layer then calls `attend` instead of `varlen_attention`. The context holds the ring's
    ranks and the shard layout, so the model stays free of collectives and nothing is looked up globally.
    A context may also carry `moe_tokens`, how an MoE router sees the rank's tokens (megalm/model/moe.py's
    `TokenShard`): a zigzag shard, or a padded micro-batch whose context attends locally
    (megalm/parallel/microbatch.py's `PaddedContext`).
    """

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str, dropout_p: float = 0.0,
               scale: float | None = None, window: int | None = None) -> torch.Tensor: ...


class Attention(nn.Module):
    """Multi-head / grouped-query causal self-attention over packed documents.

    q, k and v come out of one GEMM (`qkv_proj`, rows [q; k; v]: megalm/model/fused.py) and `o_proj` maps the
    heads back; both are `Linear` (nn.Linear with precision / weight-gradient hooks). The heads are inferred from
    the widths (q's from `o_proj`'s input, k's and v's from the rest of `qkv_proj`'s output), so tensor
    parallelism can swap in column/row-parallel layers that hold only this rank's heads without touching this
    module. The core op is `varlen_attention` over the local documents, or the micro-batch's `AttentionContext`.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_heads
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        q_width, kv_width = cfg.num_heads * self.head_dim, cfg.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, q_width + 2 * kv_width, bias=cfg.bias or cfg.qkv_bias)
        self.o_proj = Linear(q_width, cfg.hidden_size, bias=cfg.bias)
        # QK-norm (Qwen3): RMSNorm over each head of q and k, before RoPE; one [head_dim] weight each, every head's
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.dropout_p = cfg.attention_dropout
        self.window = cfg.sliding_window  # each token's last keys, itself included (None: its whole document)
        self.backend = cfg.attention_backend
        # (device type, dtype, dropout on) -> the backend chosen for it, filled by `choose_attention_backends` before
        # the first step, so that the forward (which torch.compile traces) neither selects nor logs.
        self.chosen: dict[tuple[str, torch.dtype, bool], str] = {}

    def forward(
        self,
        x: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        context: AttentionContext | None = None,
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; `rope` = (cos, sin) [T, head_dim] or None (no rotary). (Under sequence
        parallelism x and the result are this rank's [T/tp, hidden] tokens: the projections take care of it.)"""
        qkv = self.qkv_proj(x)
        total = qkv.shape[0]
        q_width = self.o_proj.weight.shape[-1]  # this rank's query heads x head_dim: o_proj's input
        kv_width = (qkv.shape[-1] - q_width) // 2
        q, k, v = (t.view(total, -1, self.head_dim) for t in qkv.split([q_width, kv_width, kv_width], dim=-1))
        if rope is not None or self.q_norm is not None:
            # q and k become new tensors below, and attention saves v: as a view it would keep the whole [T, q + 2 kv]
            # output alive. Without either (GPT-2's learned positions) attention saves q and k as views of that
            # output, which stays alive anyway: a copy of v would be T·kv·head_dim more a layer.
            v = v.contiguous()
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            cos, sin = rope
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        dropout_p = self.dropout_p if self.training else 0.0
        backend = self.chosen.get((q.device.type, q.dtype, dropout_p > 0.0))
        if backend is None:  # not chosen ahead (a model used outside the trainer): select here, eagerly
            backend = _resolve_backend(self.backend, q.device, q.dtype, dropout_p > 0.0, self.window is not None)
        window = {} if self.window is None else {"window": self.window}  # (a context without windows takes none)
        if context is not None:
            out = context.attend(q, k, v, backend, dropout_p, **window)
        else:
            out = varlen_attention(q, k, v, cu_seqlens, max_seqlen, backend, dropout_p=dropout_p, **window)
        return self.o_proj(out.reshape(total, -1))


def choose_attention_backends(model: nn.Module, device: torch.device, dtype: torch.dtype) -> set[str]:
    """Select (and log, once per choice) the attention backend of every `Attention` in `model` for q of `dtype` on
    `device`, with attention dropout on and off, before the first forward: what torch.compile traces then holds
    no selection and no logging. Returns the backends chosen."""
    chosen = set()
    for module in model.modules():
        if isinstance(module, Attention):
            for dropout in {False, module.dropout_p > 0.0}:
                backend = _resolve_backend(module.backend, torch.device(device), dtype, dropout,
                                           module.window is not None)
                module.chosen[(torch.device(device).type, dtype, dropout)] = backend
                chosen.add(backend)
                if backend == "cudnn":
                    _log_equal_documents_kernel(torch.device(device), dtype, module.num_heads, module.num_kv_heads,
                                                module.head_dim)
    return chosen


def _equal_documents_kernel(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> str:
    """The kernel torch SDPA picks for causal attention of this shape on `device`, in training (inputs that need
    grad: some kernels take a head size forward only), asked on empty tensors."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return "not probed (no CUDA device in this process)"
    q = torch.empty(1, heads, 256, head_dim, dtype=dtype, device=device, requires_grad=True)
    kv = torch.empty(1, kv_heads, 256, head_dim, dtype=dtype, device=device, requires_grad=True)
    return compat.sdpa_kernel_choice(q, kv, kv, enable_gqa=heads != kv_heads)


@functools.cache
def _log_equal_documents_kernel(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int,
                                head_dim: int) -> str:
    """Log (once per shape) which kernel torch SDPA runs for the cudnn backend's micro-batches of equal documents,
    asked of the dispatcher on empty tensors of this device: a warning where it is not cuDNN's (torch keeps cuDNN's
    kernel off an older cuDNN, a GPU it does not prefer it on, a head size or dtype it does not take, deterministic
    mode, or a user's `torch.backends.cuda` switch), so the kernel that runs is never a silent fallback. Without a
    CUDA device in the process (a simulated GPU) nothing is asked."""
    kernel = _equal_documents_kernel(device, dtype, heads, kv_heads, head_dim)
    other = kernel != "cuDNN" and not kernel.startswith("not probed")
    logger.log(logging.WARNING if other else logging.INFO,
               "attention backend cudnn: documents of equal lengths run torch SDPA's %s kernel (%d query heads, %d kv "
               "heads, head_dim %d, %s%s); unequal ones torch_varlen", kernel, heads, kv_heads, head_dim,
               str(dtype).removeprefix("torch."), ": not cuDNN's, torch did not choose it here" if other else "")
    return kernel
