"""HDP cost-model calibration: measure the cost model's coefficients on one device and write a cost YAML.

    python tools/bench/hdp_calibrate.py model=7b --base configs/hdp_cost/h100_7b.yaml --out /tmp/h100_7b.yaml
    python tools/bench/hdp_calibrate.py model=tiny --device cpu --base configs/hdp_cost/h100_7b.yaml \
        --out /tmp/hdp_cost_tiny.yaml --budget-s 30                     # the same code on CPU (CI)

What it measures, on ONE real megalm transformer block of the model config's shape, built and run as the trainer
runs it (meta-device GPT, the precision recipe's `convert`, `parallel.recompute`, `init_weights`, the recipe's
working dtype; forward inside the recipe's forward context; precision=bf16 (bf16 weights) on CUDA unless
`precision=` says otherwise; `model.attention_backend`,
`auto` by default):

- a, b, c: forward + backward of the block on packed micro-batches of documents s_i, chosen so that Σs_i² and
  Σs_i vary independently (one long document vs many short ones of the same total, several totals, and mixed
  lengths); warmup calls, then the median of timed calls (CUDA events; perf_counter on CPU). Fit of
  t = a·Σs_i² + b·Σs_i + c by non-negative least squares on the relative error (`fit_cost`).
- head: embedding + final norm + LM head + loss, forward + backward, at three token counts, timed in turn (the
  fastest of each); the slope per token.
- act_bytes, act_fixed: CUDA allocator (memory_allocated / max_memory_allocated) at two token counts, per block and
  for the head (`memory_line`); on CPU the live storage of the tensors autograd saves (no transient peaks), and
  capacity is not derived (no device memory to fill).
- capacity: (0.9·HBM − 4 GiB − act_fixed) / act_bytes, rounded down to a power of two (as the base file derives it).
- host_bw: pinned host <-> device copies of 256 MiB, the slower direction (CUDA only).

bw_intra, bw_inter, latency, overlap and ranks_per_node need two GPUs or nodes: they are kept from `--base` and
marked "not measured (one GPU)" in the written file. The run stops measuring when `--budget-s` (counted from the
process start) nears and always writes the file with what it has. Exit code 0: written with a fit; 1: written, but
fewer than 3 points fit in the budget (a, b, c kept from the base); 2: bad input (one line on stderr).
Arguments without dashes are Hydra overrides of configs/config.yaml, as in tools/bench/throughput.py.

This file is the command line and the run (the budget, the phases, main); the fit is tools/bench/hdp_calibrate_fit.py,
the block measured tools/bench/hdp_calibrate_bench.py, the YAML written tools/bench/hdp_calibrate_yaml.py.
"""

from __future__ import annotations

import time

_PROCESS_START = time.monotonic()  # the budget counts from here (before the imports), so --budget-s bounds the run

import argparse  # noqa: E402
import contextlib  # noqa: E402
import functools  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import yaml  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from megalm import compat  # noqa: E402
from megalm.measure.op_cost import GPUS  # noqa: E402
from megalm.model.attention import one_kernel_backend  # noqa: E402
from megalm.parallel.hdp.cost import CostModel  # noqa: E402
from megalm.precision import compute_dtype  # noqa: E402
from tools.bench.cli import parse_flags_and_overrides, run_main  # noqa: E402

# The fit, the block measured and the YAML live beside this file; their names stay importable from here.
from tools.bench.hdp_calibrate_bench import HOST_COPY_BYTES, Bench, MemoryLine, Point  # noqa: E402, F401
from tools.bench.hdp_calibrate_fit import Fit, design_points, fit_cost, fit_line  # noqa: E402, F401
from tools.bench.hdp_calibrate_yaml import (  # noqa: E402, F401
    INT_KEYS,
    KEYS,
    TEXT_KEYS,
    TWO_GPU_KEYS,
    derive,
    format_value,
    write_yaml,
)

DEFAULTS = {  # per device: (max tokens per micro-batch, shortest document, warmup calls, timed calls)
    "cuda": (16384, 256, 3, 10),
    "cpu": (1024, 64, 1, 3),
    "roofline": (16384, 256, 0, 1),
}


class BadInput(Exception):
    """Something the user passed cannot work; the message is the one line printed."""


@dataclass
class Clock:
    """The run's budget: deadline = process start + budget − a reserve for fitting and writing."""

    start: float
    budget: float
    reserve: float = field(default=1.0)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.budget - self.reserve - self.elapsed()


# ---------------------------------------------------------------------------------------------
# Config and checks (the YAML written: tools/bench/hdp_calibrate_yaml.py)


def compose_config(overrides: list[str], device: str):
    """megalm's config as tools/bench/throughput.py composes it; bf16 on CUDA unless `precision=` is given (the
    trainer's choice for a GPU), the config's precision on CPU; errors as one line."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from megalm.config import register_schema, to_dataclass
    from megalm.errors import MegalmError
    from megalm.train import CONFIG_DIR
    from megalm.training.validation import validate_run

    register_schema()
    base = ["data=synthetic", "trainer.eval_interval=0", "trainer.save_interval=0", "logging.tensorboard=false",
            f"trainer.device={device}", *(["precision=bf16"] if device == "cuda" else [])]
    model = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] in ("model", "+model")), None)
    if model is not None and not (Path(CONFIG_DIR) / "model" / f"{model}.yaml").is_file():
        known = sorted(p.stem for p in (Path(CONFIG_DIR) / "model").glob("*.yaml"))
        raise BadInput(f"unknown model {model!r}: pick one of {', '.join(known)} (configs/model)")
    first_line = lambda e: (str(e).strip().splitlines() or [type(e).__name__])[0]
    try:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            cfg = to_dataclass(compose(config_name="config", overrides=base + overrides))
    except (HydraException, OmegaConfBaseException, MegalmError, ValueError) as e:
        raise BadInput(f"bad override: {first_line(e)}") from e
    if cfg.parallel.tp != 1:
        raise BadInput(f"parallel.tp={cfg.parallel.tp}: this tool times one block on one GPU; calibrate with "
                       "parallel.tp=1 (a TP group's cost model is not measured here)")
    try:
        return validate_run(cfg, 1)
    except (MegalmError, ValueError) as e:
        raise BadInput(f"config: {first_line(e)}") from e


def check_out(path: Path) -> None:
    """--out must be a file we can write: its folder exists and is writable, and it is not a folder."""
    if path.is_dir():
        raise BadInput(f"--out {path} is a directory; give a file path such as {path / 'hdp_cost.yaml'}")
    parent = path.parent
    if not parent.is_dir():
        raise BadInput(f"--out {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise BadInput(f"--out {path} is not writable")


def load_base(path: Path) -> dict:
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
        model = CostModel.from_dict(data)  # the file's keys, with the values CostModel read (c: 1e-3: a string)
        return {key: getattr(model, key) for key in data}
    except (OSError, ValueError, TypeError, yaml.YAMLError) as e:
        raise BadInput(f"--base {path}: not a cost-model YAML ({str(e).splitlines()[0]})") from e


# ---------------------------------------------------------------------------------------------
# The run


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])

    def one_line_error(message: str):
        raise BadInput(message)

    parser.error = one_line_error  # type: ignore[method-assign]
    parser.add_argument("--base", required=True, type=Path,
                        help="cost YAML whose unmeasured keys (links, overlap) are kept, e.g. "
                        "configs/hdp_cost/h100_7b.yaml (required)")
    parser.add_argument("--out", required=True, type=Path, help="the cost YAML to write")
    parser.add_argument("--budget-s", type=float, default=180.0,
                        help="seconds for the whole run, from process start (default 180)")
    parser.add_argument("--device", choices=("cuda", "cpu", "roofline"), default="cuda",
                        help="cuda: time on the GPU; cpu: the same code on the CPU (CI); roofline: no device, the "
                        "block's ops traced under fake tensors and priced on --gpu (the estimator's step time; "
                        "FP8 recipes as that GPU runs them)")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h100", help="--device roofline: the GPU priced")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="largest micro-batch in tokens (default 16384 on CUDA, 1024 on CPU)")
    parser.add_argument("--min-doc", type=int, default=None,
                        help="shortest document in tokens (default 256 on CUDA, 64 on CPU)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per point (default 10 CUDA, 3 CPU)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls per point (default 3 CUDA, 1 CPU)")
    args, overrides = parse_flags_and_overrides(parser, argv)
    max_tokens, min_doc, warmup, repeats = DEFAULTS[args.device]
    args.max_tokens = args.max_tokens or max_tokens
    args.min_doc = args.min_doc or min_doc
    args.warmup = warmup if args.warmup is None else args.warmup
    args.repeats = repeats if args.repeats is None else args.repeats
    if args.budget_s <= 0:
        raise BadInput(f"--budget-s {args.budget_s}: must be positive")
    if args.device != "roofline" and any(a == "--gpu" or a.startswith("--gpu=") for a in argv):  # timed: its own
        raise BadInput(f"--gpu prices --device roofline only; --device {args.device} times the device itself: drop "
                       "--gpu, or add --device roofline")
    if args.min_doc < 1 or args.max_tokens < 2 * args.min_doc:
        raise BadInput(f"--max-tokens {args.max_tokens} must be at least twice --min-doc {args.min_doc} (>= 1)")
    if args.repeats < 1 or args.warmup < 0:
        raise BadInput("--repeats must be >= 1 and --warmup >= 0")
    return args, overrides


def measure(args: argparse.Namespace, cfg, device: torch.device, clock: Clock) -> dict:
    """All phases, each only if the budget leaves room for it; returns what was measured."""
    bench = Bench(cfg, device, args.warmup, args.repeats, roofline=args.gpu if args.device == "roofline" else None)
    bench.first_calls(args.min_doc)
    found: dict = {"backend": bench.attention_backend(), "dtype": str(bench.compute_dtype).removeprefix("torch."),
                   "recompute": bench.recompute, "precision": cfg.precision.name, "points": [], "skipped": [],
                   "bench": bench}
    calls = args.warmup + args.repeats
    top = args.max_tokens
    # Seconds per token of a warm call at 2·min_doc tokens (launch-bound on a GPU, so an overestimate for large
    # micro-batches); the budget checks below use it until the fit can predict. The faster of two calls: the first
    # at a new shape pays one-time costs, and beside another CI worker it once took 25x the next one's time, enough
    # to skip the head for budget.
    warm = bench.block_inputs((2 * args.min_doc,))
    per_token = float("inf")
    for _ in range(2):
        bench._sync()
        t0 = time.perf_counter()
        bench.block_call(warm)
        bench._sync()
        per_token = min(per_token, max((time.perf_counter() - t0) / (2 * args.min_doc), 1e-9))
    del warm

    def affordable(tokens: float, n_calls: int) -> bool:
        return clock.left() > 2.0 * per_token * tokens * n_calls

    def out_of_memory(what: str) -> None:
        torch.cuda.empty_cache()
        found["skipped"].append(f"{what} (out of memory at {top} tokens: lower --max-tokens)")
        print(f"  {what}: out of memory at {top} tokens; skipped", flush=True)

    if affordable(top * 1.25, 4):  # a block and a head call at top/4 and at top tokens
        try:
            found["memory"] = bench.memory_line([top // 4, top])
        except torch.cuda.OutOfMemoryError:
            out_of_memory("memory")
    else:
        found["skipped"].append("memory (budget)")
    head_tokens = [top // 4, top // 2, top]
    if affordable(sum(head_tokens), calls):
        try:
            head_times = bench.fastest_interleaved([functools.partial(bench.head_call, bench.head_inputs(n))
                                                    for n in head_tokens])
            found["head"] = (fit_line(head_tokens, head_times), head_times, head_tokens)
        except torch.cuda.OutOfMemoryError:
            out_of_memory("head")
    else:
        found["skipped"].append("head (budget)")
    if device.type == "cuda":
        if clock.left() > 5.0:
            found["host_bw"] = bench.host_bandwidth()
        else:
            found["skipped"].append("host_bw (budget)")
    design = design_points(args.max_tokens, args.min_doc)
    too_big: int | None = None
    for lengths in design:
        tokens = sum(lengths)
        if too_big is not None and tokens >= too_big:
            found["skipped"].append(f"{len(lengths)} docs, {tokens} tokens (out of memory)")
            continue
        points: list[Point] = found["points"]
        if len(points) >= 3:
            fit = fit_cost([p.sum_sq for p in points], [p.tokens for p in points], [p.seconds for p in points])
            guess = max(fit.predict(sum(s * s for s in lengths), tokens), per_token * tokens)
        else:
            guess = per_token * tokens * 2
        if clock.left() < 1.5 * guess * calls + 0.05:
            found["skipped"].append(f"{len(design) - design.index(lengths)} points (budget)")
            break
        inp = bench.block_inputs(lengths)
        try:
            seconds, spread = bench.time_calls(functools.partial(bench.block_call, inp))
        except torch.cuda.OutOfMemoryError:
            del inp
            torch.cuda.empty_cache()
            too_big = tokens
            print(f"  {tokens} tokens: out of memory; skipping micro-batches this large", flush=True)
            continue
        del inp
        point = Point(tuple(lengths), seconds, spread)
        points.append(point)
        per_token = max(per_token if len(points) > 1 else 0.0, seconds / tokens)
        print(f"  point {len(points):2d}: {point.label():>14} tokens {tokens:>6} sum_sq {point.sum_sq:>12.4g} "
              f"{seconds * 1e3:9.3f} ms (spread {spread:.1%})", flush=True)
    return found


def main(argv: list[str] | None = None) -> int:
    """Run the calibration; returns the exit code (0 written with a fit, 1 written without one, 2 bad input).
    The budget counts from the process start when run as a script, from this call otherwise."""
    started = _PROCESS_START if argv is None else time.monotonic()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args, overrides = parse_args(argv)
        args.argv = argv
        check_out(args.out)
        if args.out.resolve() == args.base.resolve():  # a shipped cost model replaced by this machine's fit
            raise BadInput(f"--out {args.out} is --base: write the fit elsewhere (the base keeps the keys it cannot "
                           "measure)")
        base = load_base(args.base)
        if args.device == "cuda" and not torch.cuda.is_available():
            raise BadInput("--device cuda but no CUDA device is visible (torch.cuda.is_available() is False); "
                           "use --device roofline (any model, no GPU) or --device cpu with a small model (model=tiny)")
        if args.device == "roofline":  # priced as the GPU runs it: bf16 unless precision= says otherwise
            precision = [] if any(o.startswith("precision=") for o in overrides) else ["precision=bf16"]
            cfg = compose_config(precision + overrides, "cpu")
        else:
            cfg = compose_config(overrides, args.device)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)
    device = torch.device("cpu" if args.device == "roofline" else args.device)
    backend = one_kernel_backend(cfg.model.attention_backend, device, compute_dtype(cfg.precision),
                                 dropout=cfg.model.attention_dropout > 0)
    if backend != cfg.model.attention_backend:
        print(f"model.attention_backend={backend}: auto would run cudnn here, whose documents of equal lengths (most "
              "design points) take another kernel than HDP's packed micro-batches and ring blocks", flush=True)
        cfg.model.attention_backend = backend
    clock = Clock(started, args.budget_s, reserve=min(3.0, 0.03 * args.budget_s))
    print(f"calibrating {cfg.model.name} on {args.device}: micro-batches up to {args.max_tokens} tokens, documents "
          f">= {args.min_doc}, budget {args.budget_s:g} s", flush=True)
    # --device roofline: sizes only, and an FP8 recipe's GEMMs and casts traced as the priced GPU runs them
    with contextlib.ExitStack() as stack:
        if args.device == "roofline":
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            stack.enter_context(compat.fp8_traced_as_gpu(GPUS[args.gpu].capability))
        found = measure(args, cfg, device, clock)
    values, notes, header, fit = derive(found, base, cfg, device, args, args.out)
    write_yaml(args.out, values, notes, header)
    n = len(found["points"])
    summary = ", ".join(f"{k}={values[k]:.4g}" + (f" ({values[k] / base[k]:.2f}x base)" if base.get(k) else "")
                        for k in ("a", "b", "c", "head", "act_bytes", "act_fixed", "host_bw"))
    print(f"attention backend {found['backend']}, precision {found['precision']}; {summary}; "
          f"capacity={values['capacity']}")
    if fit is None:
        print(f"error: only {n} points within --budget-s {args.budget_s:g}: a, b, c kept from {args.base}; "
              f"wrote {args.out} anyway; raise --budget-s", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {n} points fit, residuals rms {fit.rms:.1%}, {clock.elapsed():.1f} s")
    return 0


if __name__ == "__main__":
    run_main(main)
