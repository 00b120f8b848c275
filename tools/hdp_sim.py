"""Simulate one training step under the ways of spreading variable-length documents over ranks.

    python tools/hdp_sim.py                      # 256 ranks, 256K context, the long tail below, 7b
    python tools/hdp_sim.py --ranks 1024 --context 2M --lengths longtail --model 7b --offload
    python tools/hdp_sim.py --ranks 1024 --context 128K --lengths tools/data/seqlen/prolong_lengths.json \
        --model 7b --global-tokens 33554432 --json --png-dir docs/hdp
    python tools/hdp_sim.py --ablation --ranks 1024 --steps 2            # ByteScale's ablation, 16 settings

Policies (megalm/parallel/hdp/planner.py and baselines.py): `static` (pack to the context length, fixed cp group,
flat ring attention), the `megatron_hybrid` rule (power-of-two CP groups, s²/d estimate, greedy rounds) and `hdp`
(ByteScale's HDP as megalm plans it: rings sized against the step's makespan, hierarchical across nodes,
cost-balanced); with --offload also `hdp_offload` (+ ByteScale's selective offload: a document may offload up to
r(s) of its activations and run on fewer ranks, cost.offload_ratio; the plan without offload competes). Each step
draws a global batch of --global-tokens tokens (seeded), cuts documents longer than the context into
context-length pieces, plans it with each policy and runs the plan through the same execution model and cost model
(megalm/parallel/hdp/cost.py).
Prints step time, utilisation, CP traffic, padding and speedups, then the exposed CP communication per document-
length bucket; with --json the last stdout line is one JSON object with the step seconds per policy and
`plan_seconds` (HDP planner wall time);
with --png-dir, one Gantt chart per policy (rows = ranks, at most 128 drawn; x = time up to that plan's step,
or up to the slowest policy's with --shared-x, to compare widths)
and `<prefix>balance.png`, the histogram of per-rank busy time under every policy (megalm.plot;
needs matplotlib: pip install 'megalm[plots]').

`--ablation` reproduces ByteScale's ablation (static -> + dynamic communication -> + selective offload -> + balance)
and adds megalm's hierarchical CP, at 256K, 512K, 1M and 2M, for the long tail and the ProLong sample, 7B and 70B
(`ABLATION`); --ranks, --steps, --global-tokens and --seed apply.

`--lengths longtail`: a parametric long tail calibrated to ByteScale's published statistics for
its pretraining mix (arXiv 2502.21231, §2, Fig. 4): 80% of sequences ≤ 4K; the 1% ≥ 128K hold
44.3% of tokens; the 0.05% ≥ 2M hold 12.1%; 37% of tokens in sequences > 256K. It is a piecewise
truncated power law; the two free exponents are solved from those numbers (`calibrate_longtail`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megalm.errors import MegalmError  # noqa: E402
from megalm.parallel.hdp import (  # noqa: E402
    Plan,
    SimResult,
    TooFewRanks,
    check_plan,
    plan_hdp,
    plan_megatron_hybrid,
    plan_static,
    simulate,
)
from megalm.parallel.hdp.cost import CostModel, load_cost  # noqa: E402
from megalm.parallel.hdp.pipelined import align_rings  # noqa: E402
from tools.bench.cli import run_main  # noqa: E402

POLICIES = ("static", "megatron_hybrid", "hdp")
K, M = 1024, 1024 * 1024


def parse_size(text: str | int) -> int:
    """'2M' -> 2097152, '256K' -> 262144, '131072' -> 131072, '32M' -> 33554432."""
    text = str(text).strip().upper()
    scale = {"K": K, "M": M, "G": K * M}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def size(text: str) -> int:
    """`parse_size` as an argparse type: a value it cannot read names the forms it reads."""
    try:
        return parse_size(text)
    except (ValueError, OverflowError):  # OverflowError: inf
        raise argparse.ArgumentTypeError(f"{text!r} is no size: write e.g. 2M, 256K or 131072") from None


def size_name(n: int) -> str:
    for unit, scale in (("M", M), ("K", K)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


# ---------------------------------------------------------------------------------------------
# Long-tail length distribution


def _pl_mean(lo: float, hi: float, alpha: float) -> float:
    """Mean of a power law with density ∝ s^-alpha on [lo, hi]."""
    if abs(alpha - 1) < 1e-9:
        return (hi - lo) / math.log(hi / lo)
    if abs(alpha - 2) < 1e-9:
        return math.log(hi / lo) / (1 / lo - 1 / hi)
    e1, e2 = 1 - alpha, 2 - alpha
    return e1 / e2 * (hi**e2 - lo**e2) / (hi**e1 - lo**e1)


def _pl_sample(u: np.ndarray, lo: float, hi: float, alpha: float) -> np.ndarray:
    if abs(alpha - 1) < 1e-9:
        return lo * (hi / lo) ** u
    e = 1 - alpha
    return (lo**e + u * (hi**e - lo**e)) ** (1 / e)


def _solve_alpha(lo: float, hi: float, mean: float) -> float:
    a, b = -6.0, 8.0  # the mean decreases with alpha
    if not _pl_mean(lo, hi, b) < mean < _pl_mean(lo, hi, a):
        raise ValueError(f"no power law on [{lo}, {hi}] has mean {mean}")
    for _ in range(100):
        mid = (a + b) / 2
        a, b = (mid, b) if _pl_mean(lo, hi, mid) > mean else (a, mid)
    return (a + b) / 2


def calibrate_longtail() -> list[tuple[float, float, float, float]]:
    """Segments (probability, lo, hi, alpha) of the long-tail mix. Fixed shapes: log-uniform on
    [128, 4K] (80% of sequences), on [128K, 256K] and on [2M, 4M] (the 0.05%); the exponents on
    [4K, 128K] and [256K, 2M] and the split of the 1% ≥ 128K follow from the token shares."""
    p1, p5 = 0.80, 0.0005
    m1, m3, m5 = _pl_mean(128, 4 * K, 1), _pl_mean(128 * K, 256 * K, 1), _pl_mean(2 * M, 4 * M, 1)
    mean = p5 * m5 / 0.121  # tokens per sequence, from the 12.1% held by sequences ≥ 2M
    p3 = (0.443 - 0.37) * mean / m3  # [128K, 256K] holds 44.3% - 37%
    p4 = 0.01 - p5 - p3
    a4 = _solve_alpha(256 * K, 2 * M, (0.37 - 0.121) * mean / p4)
    p2 = 1 - p1 - 0.01
    a2 = _solve_alpha(4 * K, 128 * K, ((1 - 0.443) * mean - p1 * m1) / p2)
    return [(p1, 128, 4 * K, 1.0), (p2, 4 * K, 128 * K, a2), (p3, 128 * K, 256 * K, 1.0),
            (p4, 256 * K, 2 * M, a4), (p5, 2 * M, 4 * M, 1.0)]


def sample_longtail(n: int, rng: np.random.Generator) -> np.ndarray:
    """n document lengths from the calibrated long tail (uncapped)."""
    segs = calibrate_longtail()
    cum = np.cumsum([p for p, *_ in segs])
    which = np.minimum(np.searchsorted(cum, rng.random(n), side="right"), len(segs) - 1)
    u = rng.random(n)
    out = np.empty(n)
    for k, (_, lo, hi, alpha) in enumerate(segs):
        sel = which == k
        out[sel] = _pl_sample(u[sel], lo, hi, alpha)
    return np.maximum(1, out.astype(np.int64))


def global_batch(source, context: int, tokens: int, rng: np.random.Generator) -> list[int]:
    """Draw documents until `tokens` tokens; documents longer than the context are cut into
    context-length pieces (as a pretraining data pipeline does); the last one is trimmed to fit."""
    out: list[int] = []
    total = 0
    while total < tokens:
        if isinstance(source, str):
            draw = sample_longtail(4096, rng)
        else:
            draw = source[rng.integers(0, len(source), 4096)]
        for s in draw.tolist():
            while s > 0 and total < tokens:
                piece = min(s, context, tokens - total)
                out.append(piece)
                total += piece
                s -= piece
            if total >= tokens:
                break
    return out


# ---------------------------------------------------------------------------------------------
# Charts (megalm.plot; matplotlib is optional and imported only when a chart is drawn)

MAX_ROWS = 128  # ranks drawn per Gantt chart (evenly sampled beyond that; the title says so)


def draw_plan(path: str | Path, plan: Plan, sim: SimResult, t_max: float, title: str, rows: int = MAX_ROWS) -> None:
    """Write the plan's Gantt chart (megalm.plot.plot_hdp_plan: rows = ranks, x = time up to t_max)."""
    from megalm.plot import plot_hdp_plan, save_figure

    save_figure(plot_hdp_plan(plan, sim, t_max, title, max_rows=rows), path)


# ---------------------------------------------------------------------------------------------


# ByteScale's ablation, one cumulative step per row (plan_hdp's switches): flat rings of the fewest ranks, documents
# dealt by tokens; + offload; + the makespan balance; + megalm's hierarchical CP. "static" is the baseline.
ABLATION = {
    "+dynamic comm": dict(balance=False, hierarchical=False),
    "+selective offload": dict(balance=False, hierarchical=False, offload=True),
    "+balance": dict(hierarchical=False, offload=True),
    "+hierarchical CP": dict(offload=True),
}
PROLONG = Path(__file__).resolve().parent / "data" / "seqlen" / "prolong_lengths.json"
BUCKETS = ("<= C", "C-64K", "64K-256K", "256K-1M", "> 1M")  # of the longest document's length (exposure_by_length)


def run_step(lengths: list[int], args, cost: CostModel, capacity: int):
    """Plan and simulate one global batch with every policy. Returns {policy: (plan, sim)}, plan time."""
    out = {}
    t0 = time.perf_counter()
    hdp = plan_hdp(lengths, args.ranks, capacity, cost, pp=args.pp)
    plan_seconds = time.perf_counter() - t0
    plans = {
        "static": plan_static(lengths, args.ranks, capacity, args.context, cost),
        "megatron_hybrid": plan_megatron_hybrid(lengths, args.ranks, capacity),
        "hdp": hdp,
    }
    if args.offload:  # ByteScale's selective offload, the plan without it competing
        plans["hdp_offload"] = plan_hdp(lengths, args.ranks, capacity, cost, pp=args.pp, offload=True)
    for name, plan in plans.items():
        if args.pp > 1 and name.startswith("hdp"):  # as the trainer runs it (HdpSplit.plan): 1F1B needs rings aligned
            plan = align_rings(plan)
        if args.check:
            check_plan(plan, lengths, args.ranks, capacity, offload=cost if "offload" in name else None)
        out[name] = (plan, simulate(plan, cost, pp=args.pp))
    return out, plan_seconds


def exposure_by_length(plan: Plan, sim: SimResult, lengths: list[int], capacity: int) -> dict[str, list[float]]:
    """{bucket: [exposed CP communication, busy] rank-seconds} of the micro-batches whose longest document falls in
    each length bucket (`BUCKETS`; C = capacity)."""
    tops = (capacity, 64 * K, 256 * K, M, math.inf)
    out: dict[str, list[float]] = {}
    for k, mb in enumerate(plan.micro_batches):
        if not mb.seqs:
            continue
        s = max(lengths[i] for i in mb.seqs)
        name = next(n for n, top in zip(BUCKETS, tops, strict=True) if s <= top)
        c, e = sim.durations[k]
        sums = out.setdefault(name, [0.0, 0.0])
        sums[0] += e * len(mb.ranks)
        sums[1] += (c + e) * len(mb.ranks)
    return out


def ablation(args) -> dict:
    """The ablation table: per model, length distribution and context, each policy's mean step over --steps
    batches and its speedup over the row before."""
    results = {}
    print(f"ByteScale's ablation on {args.ranks} ranks, {size_name(args.global_tokens)} tokens per step, "
          f"{args.steps} step(s), seed {args.seed}; step seconds (speedup over the previous row)")
    names = ("static", *ABLATION)
    print(f"{'model':<5} {'lengths':<8} {'context':>7} " + " ".join(f"{n:>20}" for n in names))
    sources = {"longtail": "longtail", "prolong": np.asarray(json.loads(PROLONG.read_text()), np.int64)}
    for model in ("7b", "70b"):
        cost = model_cost(model)
        for dist, source in sources.items():
            for context in (256 * K, 512 * K, M, 2 * M):
                rng = np.random.default_rng(args.seed)
                steps = {n: 0.0 for n in names}
                for _ in range(args.steps):
                    lengths = global_batch(source, context, args.global_tokens, rng)
                    static = plan_static(lengths, args.ranks, cost.capacity, context, cost, balance=False)
                    steps["static"] += simulate(static, cost).step_time
                    for name, switches in ABLATION.items():
                        plan = plan_hdp(lengths, args.ranks, cost.capacity, cost, **switches)
                        steps[name] += simulate(plan, cost).step_time
                steps = {n: t / args.steps for n, t in steps.items()}
                cells = [f"{steps['static']:>20.2f}"]
                for before, name in zip(names, names[1:], strict=False):
                    cells.append(f"{steps[name]:>12.2f} ({steps[before] / steps[name]:>4.2f}x)")
                print(f"{model:<5} {dist:<8} {size_name(context):>7} " + " ".join(cells))
                results[f"{model}/{dist}/{size_name(context)}"] = steps
    print("rows are cumulative: the static mesh, packs dealt round-robin; flat rings of the fewest ranks, documents "
          "dealt by tokens; + offload (competing with none); + the makespan balance by the cost model; + hierarchical "
          "CP")
    return results


def model_cost(model: str) -> CostModel:
    """The H100 cost YAML of `model` under configs/hdp_cost if it exists (h100_7b.yaml), else the first-principles
    preset."""
    yaml_path = Path(__file__).resolve().parents[1] / "configs" / "hdp_cost" / f"h100_{model}.yaml"
    return load_cost(str(yaml_path) if yaml_path.exists() else model)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=256,
                   help="HDP domain size D (dp·cp ranks per TP×PP position; default 256)")
    p.add_argument("--context", type=size, default=parse_size("256K"),
                   help="context length, e.g. 2M, 256K, 131072 (default 256K)")
    p.add_argument("--lengths", default=None, help="JSON list of document lengths, or 'longtail' (the default)")
    p.add_argument("--dist", choices=["longtail"], default=None, help="same as --lengths longtail")
    p.add_argument("--model", default="7b", help="1b, 7b, 13b, 70b (the configs/hdp_cost YAML of h100 and the model, "
                   "if present)")
    p.add_argument("--cost", default=None, help="cost model: preset name or YAML path (overrides --model)")
    p.add_argument("--capacity", type=size, default=None, help="tokens per rank per micro-batch (default: the cost "
                   "model's)")
    p.add_argument("--global-tokens", type=size, default=33554432, help="tokens in one global batch (default 32M)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages per HDP rank")
    p.add_argument("--seed", type=int, default=0, help="the random lengths' seed (default 0)")
    p.add_argument("--steps", type=int, default=1, help="simulate this many global batches; means are reported")
    p.add_argument("--check", action="store_true", help="also run check_plan on every plan")
    p.add_argument("--png-dir", default=None, help="write <dir>/<prefix><policy>.png Gantt charts "
                   "and <dir>/<prefix>balance.png (needs matplotlib; replaces only charts megalm drew)")
    p.add_argument("--png-prefix", default="", help="prefix of the --png-dir charts' file names")
    p.add_argument("--shared-x", action="store_true", help="draw every policy's Gantt chart on the slowest one's "
                   "time axis (default: each fitted to its own plan)")
    p.add_argument("--offload", action="store_true", help="also plan 'hdp_offload' (ByteScale's selective offload: "
                   "rings as small as ceil((1 - r(s)) s / C) ranks where that makes the step shorter)")
    p.add_argument("--ablation", action="store_true", help="print ByteScale's ablation (static, + dynamic "
                   "communication, + selective offload, + balance, + hierarchical CP) for 7B and 70B, two length "
                   "distributions and four contexts; uses --ranks, --steps, --global-tokens, --seed")
    p.add_argument("--json", action="store_true", help="also print the results as one JSON object, last")
    args = p.parse_args(argv)
    for flag in ("ranks", "context", "global_tokens", "pp", "steps", "capacity"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            p.error(f"--{flag.replace('_', '-')} {value} must be >= 1")
    if args.seed < 0:
        p.error(f"--seed {args.seed} must be >= 0")
    policies = POLICIES + (("hdp_offload",) if args.offload else ())
    if args.ablation:  # its own models, distributions and contexts: the other flags were accepted and ignored
        unread = [f"--{name.replace('_', '-')}" for name in ("png_dir", "lengths", "dist", "model", "cost",
                                                            "capacity", "pp", "check", "offload", "json", "context")
                  if getattr(args, name) != p.get_default(name)]
        if unread:
            p.error(f"--ablation runs its own models, length distributions and contexts and prints a table; "
                    f"{', '.join(unread)} would not be read: drop {'it' if len(unread) == 1 else 'them'} (it uses "
                    "--ranks, --steps, --global-tokens, --seed)")
        capacity = min(model_cost(model).capacity for model in ("7b", "70b"))
        if args.ranks * capacity < 2 * M:  # its largest context, over ranks of the models' capacity
            p.error(f"--ablation's 2M context needs {-(-2 * M // capacity)} ranks of {size_name(capacity)} tokens; "
                    f"--ranks {args.ranks} is fewer")
    if args.png_dir:
        from megalm.plot import check_replaceable, require_matplotlib
        from megalm.training.run_dir import check_creatable

        # refused before the simulation runs, not with a traceback after it
        if Path(args.png_dir).exists() and not Path(args.png_dir).is_dir():
            p.error(f"--png-dir {args.png_dir} is a file; name a directory for the charts")
        try:
            require_matplotlib()
            check_creatable(Path(args.png_dir), f"--png-dir {args.png_dir}", "choose a --png-dir you may write to")
            check_replaceable(*(Path(args.png_dir) / f"{args.png_prefix}{name}.png" for name in (*policies,
                                                                                                "balance")))
        except MegalmError as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
    if args.ablation:
        return ablation(args)

    source = args.lengths or args.dist or "longtail"  # bare `python tools/hdp_sim.py`: 256 ranks, 256K, long tail
    if source != "longtail":
        try:
            values = json.loads(Path(source).read_text())
        except (OSError, ValueError) as error:
            p.error(f"--lengths {source}: not a JSON list of document lengths ({error}); give a file or longtail")
        # whole numbers only: 1.9 was cut to 1 without a word, and a mapping was a traceback
        if not isinstance(values, list) or not values or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values):
            p.error(f"--lengths {args.lengths}: needs a non-empty JSON list of whole document lengths, each >= 1")
        source = np.asarray(values, dtype=np.int64)
    try:
        cost = load_cost(args.cost) if args.cost else model_cost(args.model)
    except (OSError, ValueError) as e:
        p.error(str(e))
    capacity = args.capacity if args.capacity is not None else cost.capacity
    if args.pp > 1:  # each stage offloads r(s) of its own blocks, capped to keep two of them (as the trainer's)
        cost = cost.replace(chunk_layers=max(1, cost.layers // args.pp))

    rng = np.random.default_rng(args.seed)
    totals = {k: {"step": 0.0, "compute": 0.0, "comm": 0.0, "bytes": 0.0, "pad": 0, "mbs": 0, "max_mbs": 0,
                  "min_util": 1.0, "buckets": {}} for k in policies}
    plan_times, tokens, docs, last = [], 0, 0, None
    per_step: dict[str, list[float]] = {k: [] for k in policies}
    for _ in range(args.steps):
        lengths = global_batch(source, args.context, args.global_tokens, rng)
        tokens += sum(lengths)
        docs += len(lengths)
        try:
            last, plan_seconds = run_step(lengths, args, cost, capacity)
        except TooFewRanks as e:  # a context that does not fit on the ranks
            p.error(f"{e}; raise --ranks or --capacity, or lower --context")
        except ValueError as e:
            p.error(str(e))
        plan_times.append(plan_seconds)
        for name, (plan, sim) in last.items():
            t = totals[name]
            t["step"] += sim.step_time
            per_step[name].append(sim.step_time)
            t["compute"] += sum(sim.compute)
            t["comm"] += sum(sim.comm)
            t["bytes"] += sim.cp_bytes
            t["pad"] += sim.padding
            t["mbs"] += len([mb for mb in plan.micro_batches if mb.seqs])
            t["max_mbs"] = max(t["max_mbs"], max(len(x) for x in plan.per_rank))
            t["min_util"] = min(t["min_util"], min(sim.compute) / sim.step_time)
            for bucket, (comm, busy) in exposure_by_length(plan, sim, lengths, capacity).items():
                sums = t["buckets"].setdefault(bucket, [0.0, 0.0])
                sums[0] += comm
                sums[1] += busy

    hdp_step = totals["hdp"]["step"]
    result = {name: totals[name]["step"] / args.steps for name in policies}
    result["plan_seconds"] = sum(plan_times) / len(plan_times)
    result["plan_seconds_max"] = max(plan_times)
    details = {}
    for name in policies:
        t = totals[name]
        details[name] = {
            "step_seconds": t["step"] / args.steps,
            "hdp_speedup": t["step"] / hdp_step,
            "utilization": t["compute"] / (args.ranks * t["step"]),
            "min_rank_utilization": t["min_util"],
            "exposed_comm_share": t["comm"] / (args.ranks * t["step"]),
            "cp_traffic_tb_per_step": t["bytes"] / 1e12 / args.steps,
            "padding_share": t["pad"] / (tokens + t["pad"]),
            "micro_batches_per_step": t["mbs"] / args.steps,
            "max_micro_batches_per_rank": t["max_mbs"],
            "exposed_comm_by_length": {b: comm / busy for b, (comm, busy) in t["buckets"].items() if busy},
        }
    result.update(speedup_vs_static=details["static"]["hdp_speedup"],
                  speedup_vs_megatron_hybrid=details["megatron_hybrid"]["hdp_speedup"])
    result["config"] = {"ranks": args.ranks, "context": args.context, "capacity": capacity, "cost": cost.name,
                        "lengths": "longtail" if isinstance(source, str) else args.lengths, "pp": args.pp,
                        "global_tokens": args.global_tokens, "steps": args.steps, "seed": args.seed,
                        "docs_per_step": docs / args.steps, "static_cp": last["static"][0].stats["cp"]}
    result["details"] = details
    result["per_step"] = per_step

    print(f"{args.ranks} ranks, context {size_name(args.context)}, capacity {capacity} tokens/rank, "
          f"cost {cost.name}, pp {args.pp}, {tokens // args.steps} tokens and {docs / args.steps:.0f} documents "
          f"per step, {args.steps} step(s), seed {args.seed}")
    print(f"{'policy':<16} {'step s':>9} {'hdp x':>6} {'util':>6} {'min':>6} {'comm':>6} {'CP TB':>8} {'pad':>6} "
          f"{'mbs':>7} {'max/rank':>8}")
    for name in policies:
        d = details[name]
        print(f"{name:<16} {d['step_seconds']:>9.2f} {d['hdp_speedup']:>6.2f} {d['utilization']:>6.1%} "
              f"{d['min_rank_utilization']:>6.1%} {d['exposed_comm_share']:>6.1%} "
              f"{d['cp_traffic_tb_per_step']:>8.2f} {d['padding_share']:>6.1%} "
              f"{d['micro_batches_per_step']:>7.0f} {d['max_micro_batches_per_rank']:>8}")
    print("hdp x: this policy's step time over hdp's (hdp's speed-up over it); util: compute / (ranks × step); min: "
          "the least-utilised rank; comm: exposed CP communication share; CP TB: ring traffic per step; pad: padded "
          "positions; mbs: micro-batches per step; max/rank: the most micro-batches one rank runs")
    print(f"exposed CP communication / busy time, by the micro-batch's longest document (C = {capacity}):")
    print(f"{'policy':<16} " + " ".join(f"{name:>9}" for name in BUCKETS))
    for name in policies:
        shares = details[name]["exposed_comm_by_length"]
        print(f"{name:<16} " + " ".join(f"{shares[b]:>9.1%}" if b in shares else f"{'-':>9}" for b in BUCKETS))
    print(f"HDP planning: {result['plan_seconds'] * 1e3:.1f} ms per step (max {result['plan_seconds_max'] * 1e3:.1f})")

    if args.png_dir:
        out = Path(args.png_dir)
        slowest = max(sim.step_time for _, sim in last.values())
        for name, (plan, sim) in last.items():
            t_max = 1.02 * (slowest if args.shared_x else sim.step_time)
            title = (f"{name}: {args.ranks} ranks, context {size_name(args.context)}, capacity "
                     f"{size_name(capacity)}, step {sim.step_time:.1f} s, utilisation "
                     f"{sum(sim.compute) / (args.ranks * sim.step_time):.0%}")
            path = out / f"{args.png_prefix}{name}.png"
            draw_plan(path, plan, sim, t_max, title)
            print(f"wrote {path}")
        from megalm.plot import plot_hdp_balance, save_figure

        title = (f"per-rank load, {args.ranks} ranks, context {size_name(args.context)}, "
                 f"{size_name(args.global_tokens)} tokens (last step)")
        path = save_figure(plot_hdp_balance({k: s for k, (_, s) in last.items()}, title),
                           out / f"{args.png_prefix}balance.png")
        print(f"wrote {path}")
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    run_main(main)
