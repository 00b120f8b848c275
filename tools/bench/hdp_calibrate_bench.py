"""What tools/bench/hdp_calibrate.py measures on: `Bench`, one megalm transformer block plus the embedding and head
(a one-layer GPT) built and run as the trainer runs a model, with its timings (`Point`), its memory lines
(`MemoryLine`) and the host link's bandwidth.

Why a module of its own: the measuring is the part that touches a device (or, under `--device roofline`, fake
tensors priced on a GPU's roofline); the fit and the YAML around it are plain numbers."""

from __future__ import annotations

import copy
import itertools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from megalm.estimate.layout_search import ROOFLINE_EFFICIENCY
from megalm.measure import storage_identity
from megalm.measure.op_cost import GPUS, OpCosts
from tools.bench.hdp_calibrate_fit import fit_line
from tools.bench.timing import time_calls

HOST_COPY_BYTES = 256 * 2**20


@dataclass
class Point:
    lengths: tuple[int, ...]
    seconds: float  # median of the timed calls
    spread: float  # (max − min) / median of the timed calls

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def sum_sq(self) -> int:
        return sum(s * s for s in self.lengths)

    def label(self) -> str:
        if len(set(self.lengths)) == 1:
            return f"{len(self.lengths)}x{self.lengths[0]}"
        return "+".join(str(s) for s in self.lengths)


@dataclass
class MemoryLine:
    """Bytes per token and at zero tokens, of what a block keeps for its backward (`saved`) and of the peaks above
    the state during the block's and the head's forward + backward."""

    saved: tuple[float, float]
    block_peak: tuple[float, float]
    head_peak: tuple[float, float]
    layer_state: float  # bytes of one block's parameters + gradients
    other_state: float  # embedding, final norm, LM head: parameters + gradients
    how: str
    live_saved: tuple[float, float] | None = None  # cross-check on CUDA: autograd's saved storages


class Bench:
    """One megalm transformer block plus the embedding and head (a one-layer GPT), built and run as the trainer
    builds and runs a model, and the measurements on it."""

    def __init__(self, cfg, device: torch.device, warmup: int, repeats: int, roofline: str | None = None) -> None:
        from megalm.model.gpt import GPT, init_weights
        from megalm.model.loss import TokenLoss
        from megalm.parallel.recompute import apply_recompute, stage_mode
        from megalm.precision import Precision

        self.cfg, self.device, self.warmup, self.repeats = cfg, device, warmup, repeats
        self.roofline = roofline  # a GPU name (megalm.measure.op_cost.GPUS): time = its roofline / efficiency
        self.is_cuda = device.type == "cuda"
        self.forwards = 0  # block forwards run, each a step of its own (`block_forward`)
        model_cfg = copy.deepcopy(cfg.model)
        model_cfg.num_layers = 1
        self.precision = Precision(cfg.precision, cfg.seed, device)
        # The meta skeleton is built outside the FakeTensorMode `--device roofline` runs under (as the trainer does:
        # a parameter made under it could not be swapped for its materialised self); outside one this is a no-op.
        with unset_fake_temporarily():
            model = GPT(model_cfg, device="meta")
            self.precision.convert(model)
            self.recompute = stage_mode(cfg.parallel.recompute, 0, cfg.parallel.pp)
            apply_recompute(model, self.recompute)
        # Materialise the block and the rest separately: the allocator tells each one's parameter bytes.
        working = self.precision.working_dtype  # precision=bf16: bf16 weights, as the trainer's model holds them

        def materialise(module: torch.nn.Module) -> None:
            module.to_empty(device=device)
            for param in module.parameters():  # param.data, not .to(): fake tensors cannot be swapped in
                param.data = param.data.to(working or torch.float32)

        before = self._allocated()
        materialise(model.layers)
        after_block = self._allocated()
        for name, child in model.named_children():
            if name != "layers":
                materialise(child)
        self.param_bytes = (after_block - before, self._allocated() - after_block)
        if any(p.is_meta for p in model.parameters()):
            raise RuntimeError("a parameter of the one-layer GPT stayed on the meta device")
        init_weights(model, cfg.seed)
        self.model, self.block = model, model.layers[0]
        self.loss_fn = TokenLoss(cfg.model.vocab_size)  # the trainer's: the gradient written over the logits
        self.param_ptrs = {storage_identity(p) for p in model.parameters()}
        self.compute_dtype: torch.dtype | None = None  # of q, seen on the first forward
        self.grad_bytes = (0.0, 0.0)

    # -------------------------------------------------------------- helpers

    def _allocated(self) -> int:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
            return torch.cuda.memory_allocated(self.device)
        return 0

    def _sync(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def block_inputs(self, lengths: Sequence[int]) -> dict:
        """A packed micro-batch of documents `lengths` at the block's input: hidden states [T, h] (in the embedding's
        dtype, as it gives them), cu_seqlens, positions restarting per document, RoPE computed as GPT.forward does."""
        total, hidden = sum(lengths), self.cfg.model.hidden_size
        dtype = self.model.embedding.weight.dtype
        gen = torch.Generator(device=self.device).manual_seed(total)  # drawn on the device: no host copy of [T, h]
        x = torch.randn(total, hidden, generator=gen, device=self.device).to(dtype).requires_grad_(True)
        grad = torch.randn(total, hidden, generator=gen, device=self.device).to(dtype)
        with unset_fake_temporarily():  # real offsets under --device roofline: varlen attention reads them on the host
            cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=self.device)
        positions = torch.cat([torch.arange(s) for s in lengths]).to(self.device)
        with self.precision.forward_context():
            rope = self.model.rotary(positions, dtype)
        return {"x": x, "grad": grad, "cu": cu, "max_seqlen": max(lengths), "rope": rope}

    def block_forward(self, inp: dict) -> torch.Tensor:
        # each call a step of its own: under fp8_delayed the amax history moves (the first step alone casts with the
        # current amax, a pass more than the delayed cast of every later step)
        self.forwards += 1
        self.precision.before_forward(self.model, self.forwards, 0)
        with self.precision.forward_context():
            return self.block(inp["x"], inp["cu"], inp["max_seqlen"], inp["rope"])

    def block_call(self, inp: dict) -> None:
        """Forward + backward of the block; parameter gradients accumulate as over a step's micro-batches."""
        self.block_forward(inp).backward(inp["grad"])
        inp["x"].grad = None

    def head_inputs(self, tokens: int) -> dict:
        gen = torch.Generator(device="cpu").manual_seed(tokens)
        vocab = self.cfg.model.vocab_size
        ids = torch.randint(0, vocab, (tokens + 1,), generator=gen)
        return {"tokens": ids[:-1].to(self.device), "labels": ids[1:].to(self.device),
                "mask": torch.ones(tokens, device=self.device), "positions": torch.arange(tokens).to(self.device)}

    def head_loss(self, inp: dict) -> torch.Tensor:
        """Embedding -> final norm -> LM head under the forward context, the loss outside it (as LocalRunner)."""
        with self.precision.forward_context():
            logits = self.model.head(self.model.embed(inp["tokens"], inp["positions"]))
        return self.loss_fn(logits, inp["labels"], inp["mask"])

    def head_call(self, inp: dict) -> None:
        self.head_loss(inp).backward()

    def time_calls(self, call: Callable[[], None]) -> tuple[float, float]:
        """(median seconds, (max − min) / median) of `repeats` calls after `warmup` calls. CUDA: events around each
        call from an idle device (so host launch gaps count, as they do in training); CPU: perf_counter; roofline:
        one call's ops priced on the GPU (max(FLOPs / peak, bytes / HBM bandwidth) each, megalm/measure/op_cost.py)
        and divided by megalm-estimate's ROOFLINE_EFFICIENCY, the step time the estimator reports."""
        if self.roofline is not None:
            costs = OpCosts(GPUS[self.roofline])
            with costs:
                call()
            return costs.total().ms / 1e3 / ROOFLINE_EFFICIENCY, 0.0
        times = [ms / 1e3 for ms in time_calls(call, self.device, self.warmup, self.repeats)]
        median = statistics.median(times)
        return median, (max(times) - min(times)) / median

    def fastest_interleaved(self, calls: Sequence[Callable[[], None]]) -> list[float]:
        """The fastest of `repeats` calls of each of `calls`, timed in turn (one of each per round, after `warmup`
        rounds). For a slope over a few short calls (the head's, a few ms each on a CPU): a loaded machine only adds
        time, in bursts, so the minimum is the call's own cost, and taking turns spreads a burst over every point
        instead of one. A median of each point in a row fit the head's slope negative beside another CI worker."""
        if self.roofline is not None:
            return [self.time_calls(call)[0] for call in calls]
        for _ in range(self.warmup):
            for call in calls:
                call()
        fastest = [float("inf")] * len(calls)
        for _ in range(self.repeats):
            for i, call in enumerate(calls):
                fastest[i] = min(fastest[i], time_calls(call, self.device, 0, 1)[0] / 1e3)
        return fastest

    # -------------------------------------------------------------- phases

    def first_calls(self, tokens: int) -> None:
        """The first block and head calls (they resolve the attention backend, compile kernels and create the cuBLAS
        workspaces of the forward and the backward threads), then the gradients' bytes: the gradients are dropped and
        allocated again by one more call of each, measured by the allocator on CUDA, by storage sizes on CPU."""
        inp = self.block_inputs((tokens,))
        head = self.head_inputs(tokens)
        seen: list[torch.dtype] = []
        hook = self.block.attention.qkv_proj.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
        self.block_call(inp)
        hook.remove()
        self.compute_dtype = seen[0]
        self.head_call(head)
        self.model.zero_grad(set_to_none=True)
        before = self._allocated()
        self.block_call(inp)
        block_grads = self._allocated() - before
        before = self._allocated()
        self.head_call(head)
        head_grads = self._allocated() - before
        if not self.is_cuda:
            grads = lambda mod: sum(p.grad.untyped_storage().nbytes() for p in mod.parameters() if p.grad is not None)
            params = lambda mod: sum(p.untyped_storage().nbytes() for p in mod.parameters())
            others = [m for n, m in self.model.named_children() if n != "layers"]
            block_grads, head_grads = grads(self.block), sum(grads(m) for m in others)
            self.param_bytes = (params(self.block), sum(params(m) for m in others))
        self.grad_bytes = (float(block_grads), float(head_grads))

    def attention_backend(self) -> str:
        from megalm.model.attention import select_attention_backend

        dropout = self.cfg.model.attention_dropout > 0
        return select_attention_backend(self.cfg.model.attention_backend, self.device, self.compute_dtype,
                                        dropout=dropout)

    def saved_storage(self, run: Callable[[], torch.Tensor], inputs: dict) -> tuple[torch.Tensor, int]:
        """Run a forward; return its output and the bytes of the distinct storages autograd saves for the backward,
        plus the output's. Parameters (state) and the `inputs` (the previous layer's output, counted there) are left
        out, as the allocator's count above a baseline taken after they exist leaves them out."""
        storages: dict[int, int] = {}
        skip = self.param_ptrs | {storage_identity(t) for t in inputs.values() if torch.is_tensor(t)}

        def pack(t: torch.Tensor) -> torch.Tensor:
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # a tensor subclass without one storage: not counted
                return t
            if storage_identity(st) not in skip:
                storages[storage_identity(st)] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = run()
        storages[storage_identity(out)] = out.untyped_storage().nbytes()
        return out, sum(storages.values())

    def memory_point(self, tokens: int) -> dict[str, float]:
        """Bytes above the state at `tokens` tokens (one document): the block's kept activations after its
        forward, its peak through the backward, the head's peak; CUDA from the allocator, CPU from live storage."""
        inp = self.block_inputs((tokens,))
        head = self.head_inputs(tokens)
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        base = self._allocated()
        out, live = self.saved_storage(lambda: self.block_forward(inp), inp)
        kept = self._allocated() - base
        out.backward(inp["grad"])
        inp["x"].grad = None
        del out
        block_peak = torch.cuda.max_memory_allocated(self.device) - base if self.is_cuda else live
        if self.is_cuda:
            self._sync()
            torch.cuda.reset_peak_memory_stats(self.device)
            base = self._allocated()
            self.head_call(head)
            head_peak = torch.cuda.max_memory_allocated(self.device) - base
        else:
            loss, head_peak = self.saved_storage(lambda: self.head_loss(head), head)
            loss.backward()
            del loss
        return {"saved": kept if self.is_cuda else live, "block_peak": block_peak, "head_peak": head_peak,
                "live": live}

    def memory_line(self, token_counts: Sequence[int]) -> MemoryLine:
        points = [self.memory_point(n) for n in token_counts]
        line = lambda key: fit_line(token_counts, [p[key] for p in points])
        how = ("CUDA allocator: memory_allocated after the block's forward and max_memory_allocated through its "
               "backward and the head's forward + backward, above the state" if self.is_cuda else
               "CPU: live storage of the tensors autograd saves (distinct storages; parameters and the input "
               "excluded) and the output; no transient peaks (torch has no CPU allocator statistics)")
        return MemoryLine(saved=line("saved"), block_peak=line("block_peak"), head_peak=line("head_peak"),
                          layer_state=self.param_bytes[0] + self.grad_bytes[0],
                          other_state=self.param_bytes[1] + self.grad_bytes[1], how=how,
                          live_saved=line("live") if self.is_cuda else None)

    def host_bandwidth(self, nbytes: int = HOST_COPY_BYTES) -> tuple[float, float]:
        """(host->device, device->host) bytes/s of copies between pinned host memory and the device."""
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        h2d, _ = self.time_calls(lambda: dev.copy_(host, non_blocking=True))
        d2h, _ = self.time_calls(lambda: host.copy_(dev, non_blocking=True))
        return nbytes / h2d, nbytes / d2h
