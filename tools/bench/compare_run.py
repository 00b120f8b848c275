"""What every runner of tools/bench/compare.py shares: the `Run` it returns, the `Skip` it raises, the peers' pins
(tools/compare_peers.txt), and the one way all frameworks' steps are timed, profiled and described.

Why a module of its own: the megalm rows (compare.py) and the peers (tools/bench/compare_megatron.py,
tools/bench/compare_torchtitan.py) all build on these, and no runner imports another."""

from __future__ import annotations

import contextlib
import importlib
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import torch

from megalm import compat
from megalm.config import MegalmConfig
from megalm.measure.kernel_profile import StepProfile, profile_steps
from tools.bench.throughput import synchronize

PEERS_FILE = Path(__file__).resolve().parents[1] / "compare_peers.txt"


class Skip(Exception):
    """A framework cannot run this cell here; the message says exactly why."""


@dataclass
class Run:
    """One build + warm-up + timed steps of one framework in one cell, and the kernels it ran."""

    step_seconds: list[float]
    tokens_per_step: int
    peak_memory_gib: float
    params_m: float
    kernels: dict[str, str] = field(default_factory=dict)
    profile: StepProfile | None = None  # --profile: where the time of a few more steps went
    losses: list[float] = field(default_factory=list)  # each step's loss (mean over its tokens), warm-up included
    grad_norms: list[float] = field(default_factory=list)  # each step's gradient norm before its clip


# ---------------------------------------------------------------------------------------------- pinned peers


def normalise(name: str) -> str:
    """A distribution name as pip compares them (PEP 503): lower case, runs of -_. as one dash."""
    return re.sub(r"[-_.]+", "-", name).lower()


def peer_pins(path: Path = PEERS_FILE) -> dict[str, str]:
    """{name: version} of tools/compare_peers.txt, the one place the peers' versions are pinned; any line that
    is not an exact `name==version` is an error, so that the file cannot drift into ranges."""
    pins = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)", line)
        if not match:
            raise ValueError(f"{path}: {raw.strip()!r} is not an exact name==version pin")
        pins[normalise(match[1])] = match[2]
    return pins


def version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def pin_problem(package: str) -> str | None:
    """Why `package` is not here at its pinned version (not installed, or another version); None when it is."""
    pinned = peer_pins()[normalise(package)]
    have = version(package)
    if have is None:
        return f"{package} not installed (tools/compare_peers.txt pins {pinned})"
    if have != pinned:
        return f"{package} {have} installed, but tools/compare_peers.txt pins {pinned} (the API this harness drives)"
    return None


# ---------------------------------------------------------------------------------------------- timing, kernels


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype activations (and so attention) run in: bf16 for every recipe but fp32."""
    return torch.float32 if precision == "fp32" else torch.bfloat16


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast for every recipe but fp32 (fp8 keeps the non-fp8 parts in bf16, as megalm does)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def adamw(model: torch.nn.Module, cfg: MegalmConfig, device: torch.device) -> torch.optim.Optimizer:
    """megalm's optimizer for the peers: AdamW with its hyper-parameters, the fused kernel (as megalm's auto,
    and TorchTitan's default implementation)."""
    o = cfg.optim
    return torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay,
                             fused=device.type in ("cuda", "cpu"))


def time_steps(step: Callable[[int], None], warmup: int, steps: int, device: torch.device) -> list[float]:
    """Seconds of each timed step (after `warmup` untimed ones), each bracketed by a device synchronize."""
    times = []
    for i in range(warmup + steps):
        synchronize(device)
        start = time.perf_counter()
        step(i)
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def measure(step: Callable[[int], None], warmup: int, steps: int, device: torch.device,
            profile: int = 0) -> tuple[list[float], StepProfile | None]:
    """`time_steps`, then (`profile` > 0) that many more steps under torch.profiler, untimed: the same kernel
    kinds for every framework (megalm.measure.kernel_profile), so two rows' milliseconds compare kind by kind."""
    times = time_steps(step, warmup, steps, device)
    if not profile:
        return times, None
    result = profile_steps(step, warmup + steps, profile, device)
    result.unprofiled_ms = 1e3 * statistics.median(times)
    return times, result


class PeerStep:
    """A peer's training step as its own loop runs it: per micro-batch of the step's tokens [micro-batches, batch,
    seq + 1], a forward and a backward of `loss_of(tokens)` (its mean loss per token) over the micro-batch count, so
    that the summed gradients are those of the step's mean loss (every micro-batch holds as many tokens); then the
    clip at `grad_clip`, the optimizer step, the gradients zeroed. Each step's loss and pre-clip gradient norm are
    kept as tensors, read after the timed steps (`losses`, `norms`: no host sync in a step)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float,
                 batches: list[torch.Tensor], loss_of: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.model, self.optimizer, self.grad_clip = model, optimizer, grad_clip
        self.batches, self.loss_of = batches, loss_of
        self._losses: list[torch.Tensor] = []
        self._norms: list[torch.Tensor] = []

    def __call__(self, i: int) -> None:
        step_tokens = self.batches[i % len(self.batches)]
        total = torch.zeros((), device=step_tokens.device)
        for tokens in step_tokens:
            loss = self.loss_of(tokens) / len(step_tokens)
            loss.backward()
            total += loss.detach().float()
        self._losses.append(total)
        self._norms.append(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip).detach())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def losses(self) -> list[float]:
        return [float(loss) for loss in self._losses]

    def norms(self) -> list[float]:
        return [float(norm) for norm in self._norms]


def params_m(model: torch.nn.Module) -> float:
    return sum(p.numel() for p in model.parameters()) / 1e6


def peak_memory(device: torch.device) -> float:
    from megalm.training.metrics import peak_memory_gb

    return peak_memory_gb(device)


def require(module: str, package: str) -> None:
    """Import `module` or skip: "not installed" when the package is absent, "not importable" when it breaks."""
    try:
        importlib.import_module(module)
    except ImportError as e:
        absent = isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == module.split(".")[0]
        raise Skip(f"{package} {'not installed' if absent else 'not importable'} ({type(e).__name__}: {e})") from None


def probe_sdpa(batch: int, heads: int, kv_heads: int, seq: int, head_dim: int, dtype: torch.dtype,
               device: torch.device) -> str:
    """The kernel torch SDPA runs for causal attention of this shape in training (`compat.sdpa_kernel_choice`), on
    empty [b, h, s, d] tensors that need grad (some kernels take a head size forward only)."""
    q = torch.empty(batch, heads, seq, head_dim, dtype=dtype, device=device, requires_grad=True)
    kv = torch.empty(batch, kv_heads, seq, head_dim, dtype=dtype, device=device, requires_grad=True)
    return compat.sdpa_kernel_choice(q, kv, kv, is_causal=True, enable_gqa=heads != kv_heads)


def gemm_kernels(device: torch.device, precision: str, layers: str, bf16: str = "bf16 under autocast") -> str:
    """Where bf16 and fp32 GEMMs run: cuBLAS in `bf16` (the system's recipe, autocast unless it says otherwise), or
    fp32 with the TF32 setting of this run."""
    where = "cuBLAS" if device.type == "cuda" else "CPU"
    if precision == "fp32":
        tf32 = device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32
        return f"{layers}: {where} fp32{' (TF32)' if tf32 else ''}"
    return f"{layers}: {where} {bf16}"
