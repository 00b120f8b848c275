"""The cost YAML tools/bench/hdp_calibrate.py writes: its keys, each key's value and note and the header that says
how the file was made (`derive`, from the measurements and `--base`), and the file itself (`write_yaml`, read back
with megalm.parallel.hdp.cost.CostModel.from_yaml before it returns).

Why a module of its own: what the file says about each number (measured, derived, or kept from the base) is the
calibration's record, and it reads best apart from how the numbers were measured."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import shlex
import textwrap
from pathlib import Path

import torch

from megalm.estimate.layout_search import ROOFLINE_EFFICIENCY
from megalm.estimate.rank import HBM_BYTES
from megalm.measure.op_cost import GPUS
from megalm.parallel.hdp.cost import CostModel, GiB
from tools.bench.hdp_calibrate_bench import Bench, MemoryLine, Point
from tools.bench.hdp_calibrate_fit import Fit, fit_cost

KEYS = ("a", "b", "c", "layers", "head", "kv_bytes", "qo_bytes", "heads", "comm_passes", "bw_intra", "bw_inter",
        "latency", "overlap", "ranks_per_node", "capacity", "act_bytes", "act_fixed", "host_bw", "source", "name")
TEXT_KEYS = ("source", "name")
TWO_GPU_KEYS = ("bw_intra", "bw_inter", "latency", "overlap", "ranks_per_node")  # need two GPUs or nodes
INT_KEYS = ("layers", "ranks_per_node", "capacity", "kv_bytes", "qo_bytes", "heads")


def format_value(key: str, value) -> str:
    if key in TEXT_KEYS:
        return json.dumps(str(value))  # a JSON string is a YAML string
    value = float(value)
    if key in INT_KEYS and value.is_integer():
        return str(int(value))
    if value.is_integer() and abs(value) < 1e6:
        return f"{value:.1f}"
    return f"{value:.4e}"  # always with a dot: PyYAML reads 1e-05 (no dot) as a string


def write_yaml(path: Path, values: dict, notes: dict[str, str], header: list[str]) -> None:
    """The cost-model YAML: header comment lines, then every key of the base in its order with a note on where its
    value comes from. Read back with CostModel.from_yaml before returning (the file must load as numbers)."""
    width = max(len(f"{k}: {format_value(k, values[k])}") for k in KEYS)
    wrap = lambda h: [h] if h.startswith(("Command:", "  ")) else textwrap.wrap(h, 116, subsequent_indent="  ") or [""]
    lines = [f"# {part}".rstrip() for h in header for part in wrap(h)]
    for key in KEYS:
        text = f"{key}: {format_value(key, values[key])}"
        lines.append(f"{text:<{width}}  # {notes[key]}" if notes.get(key) else text)
    path.write_text("\n".join(lines) + "\n")
    loaded = CostModel.from_yaml(path)
    bad = [k for k in KEYS if k not in TEXT_KEYS and not isinstance(getattr(loaded, k), (int, float))]
    if bad:
        raise RuntimeError(f"{path}: keys {bad} did not load as numbers")


def derive(found: dict, base: dict, cfg, device: torch.device, args: argparse.Namespace, out: Path
           ) -> tuple[dict, dict[str, str], list[str], Fit | None]:
    """The YAML's values, per-key notes and header from the measurements; unmeasured keys from `base`."""
    bench: Bench = found["bench"]
    model = cfg.model
    layers = model.num_layers
    defaults = CostModel(a=0.0, b=0.0, c=0.0)
    values = {k: base.get(k, getattr(defaults, k)) for k in KEYS}
    values["name"] = out.stem
    base_name = str(args.base)
    notes: dict[str, str] = {}
    measured: list[str] = []
    verb = f"{args.gpu} roofline / {ROOFLINE_EFFICIENCY}" if args.device == "roofline" else "measured"
    points: list[Point] = found["points"]
    fit = None
    if len(points) >= 3:
        fit = fit_cost([p.sum_sq for p in points], [p.tokens for p in points], [p.seconds for p in points])
        values.update(a=fit.a, b=fit.b, c=fit.c)
        notes["a"] = f"{verb}: s per token pair per layer (fit of {len(points)} points)"
        notes["b"] = f"{verb}: s per token per layer"
        notes["c"] = f"{verb}: s per micro-batch per layer"
        measured += ["a", "b", "c"]
    else:
        for k in "abc":
            notes[k] = f"not measured (budget: {len(points)} points, 3 needed): kept from {base_name}"
    head_dim = model.hidden_size // model.num_heads
    elem = torch.empty((), dtype=bench.compute_dtype).element_size()
    values["layers"] = layers
    values["kv_bytes"] = 2 * model.num_kv_heads * head_dim * elem
    values["qo_bytes"] = 2 * model.hidden_size * elem
    values["heads"] = model.num_kv_heads
    notes["layers"] = f"from the model config ({model.name})"
    notes["kv_bytes"] = (f"from the model config: 2 * {model.num_kv_heads} kv heads * {head_dim} * {elem} B "
                         f"({found['dtype']})")
    notes["qo_bytes"] = f"from the model config: q and the attention output, 2 * {model.hidden_size} * {elem} B"
    notes["heads"] = "from the model config: kv heads of one rank (tp=1); an all-to-all group must divide them"
    notes["comm_passes"] = f"model constant (KV fwd; KV, dKV bwd): kept from {base_name}"
    for key in TWO_GPU_KEYS:
        notes[key] = f"not measured (one GPU): kept from {base_name}"
    if "head" in found:
        (slope, intercept), _, _ = found["head"]
        values["head"] = max(slope, 0.0)
        notes["head"] = f"{verb}: s per token, embedding + LM head + loss ({intercept * 1e3:+.3f} ms per call)"
        measured.append("head")
    else:
        notes["head"] = f"not measured (budget): kept from {base_name}"
    memory_text: list[str] = []
    if "memory" in found:
        m: MemoryLine = found["memory"]
        # A step's peak: all layers' saved activations, plus the larger of the head's peak (its backward runs first)
        # and the last block's backward transient (its own saved part already counted).
        e_trans, f_trans = m.block_peak[0] - m.saved[0], m.block_peak[1] - m.saved[1]
        e = layers * m.saved[0] + max(m.head_peak[0], e_trans)
        state = layers * m.layer_state + m.other_state
        f = state + max(0.0, layers * m.saved[1] + max(m.head_peak[1], f_trans))
        values["act_bytes"], values["act_fixed"] = e, f
        measured += ["act_bytes", "act_fixed"]
        probe = "memory probe of the traced block" if args.device == "roofline" else "measured"
        notes["act_bytes"] = f"{probe}: activation bytes per token, all layers + head (see header)"
        notes["act_fixed"] = f"{probe}: parameters + gradients of all layers + head, + the line's intercept"
        memory_text = [
            f"Memory ({m.how}), at two token counts, lines bytes = e*T + f:",
            f"  block kept for backward e={m.saved[0]:.1f} B/token (f={m.saved[1]:.4g} B); block backward peak "
            f"e={m.block_peak[0]:.1f}; head peak e={m.head_peak[0]:.1f} (f={m.head_peak[1]:.4g} B)",
            *([f"  cross-check, autograd's saved storages: e={m.live_saved[0]:.1f} B/token (f={m.live_saved[1]:.4g} B)"]
              if m.live_saved else []),
            f"  act_bytes = layers*{m.saved[0]:.1f} + max(head {m.head_peak[0]:.1f}, block transient {e_trans:.1f})"
            f" = {e:.4g} B/token (recompute={found['recompute']})",
            f"  act_fixed = layers*{m.layer_state / GiB:.4f} GiB + {m.other_state / GiB:.4f} GiB (parameters + "
            f"gradients as allocated) + {max(0.0, f - state) / GiB:.4f} GiB",
            "    (the line's intercept: what a forward keeps whatever the sequence's length) = "
            f"{f / GiB:.3f} GiB;",
            "    optimizer state not counted (ZeRO-1 over the HDP domain, as the base file assumes)",
        ]
        if device.type == "cuda" or args.device == "roofline":
            hbm = (HBM_BYTES[args.gpu] if args.device == "roofline"
                   else torch.cuda.get_device_properties(device).total_memory)
            free = 0.9 * hbm - 4 * GiB - f
            if free >= e:
                values["capacity"] = 2 ** int(math.log2(free / e))
                measured.append("capacity")
                notes["capacity"] = "derived: (0.9*HBM - 4 GiB - act_fixed) / act_bytes, power of two below"
                memory_text.append(f"  capacity = (0.9*{hbm / GiB:.1f} GiB - 4 GiB - act_fixed) / act_bytes = "
                                   f"{free / e:,.0f} tokens -> {values['capacity']} (power of two below)")
            else:
                notes["capacity"] = f"not derived (model state leaves no room: {free / GiB:.1f} GiB): kept from base"
                memory_text.append(f"  capacity: 0.9*HBM - 4 GiB - act_fixed = {free / GiB:.1f} GiB, no room: kept")
        else:
            notes["capacity"] = f"not derived (CPU: no device memory to fill): kept from {base_name}"
    else:
        for k in ("act_bytes", "act_fixed", "capacity"):
            notes[k] = f"not measured (budget): kept from {base_name}"
    if "host_bw" in found:
        h2d, d2h = found["host_bw"]
        values["host_bw"] = min(h2d, d2h)
        notes["host_bw"] = f"measured: pinned copies, slower direction (h2d {h2d / 1e9:.1f}, d2h {d2h / 1e9:.1f} GB/s)"
        measured.append("host_bw")
    else:
        why = {"cpu": "CPU: no host-device link", "roofline": "roofline: no device"}.get(args.device, "budget")
        notes["host_bw"] = f"not measured ({why}): kept from {base_name}"
    notes["name"] = "the --out file's name"

    if args.device == "roofline":
        device_name = (f"none: the roofline of {GPUS[args.gpu].name} (megalm/measure/op_cost.py) / "
                       f"{ROOFLINE_EFFICIENCY} (megalm-estimate's efficiency), traced on the CPU under FakeTensorMode")
        versions = f"torch {torch.__version__}"
    elif device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
        versions = f"torch {torch.__version__}, CUDA {torch.version.cuda}"
    else:
        device_name = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
        versions = f"torch {torch.__version__}"
    command = "python tools/bench/hdp_calibrate.py " + shlex.join(args.argv)
    kept = [k for k in KEYS if k not in measured and k not in TWO_GPU_KEYS
            and k not in ("layers", "kv_bytes", "qo_bytes", "heads", "source", "name")]
    how = {"roofline": f"DERIVED WITHOUT A GPU from the {args.gpu} roofline and megalm's memory probe",
           "cuda": "MEASURED on one GPU", "cpu": "MEASURED on the CPU"}[args.device]
    values["source"] = f"tools/bench/hdp_calibrate.py --device {args.device}, {datetime.date.today()} (see the header)"
    notes["source"] = "where these numbers come from (gpu_check's calibrate step replaces a roofline file)"
    header = [
        f"HDP cost model: {model.name} shape ({layers} layers, h={model.hidden_size}, {model.num_heads} heads, "
        f"{model.num_kv_heads} kv heads, ffn={model.ffn_hidden_size}, vocab {model.vocab_size}), {how} by "
        "tools/bench/hdp_calibrate.py (read by megalm.parallel.hdp.cost.CostModel.from_yaml).",
        f"Device: {device_name}; {versions}; {datetime.date.today().isoformat()}.",
        f"Command: {command}",
        f"One block run as the trainer runs it: precision={found['precision']} (compute {found['dtype']}), attention "
        f"backend {found['backend']}, recompute={found['recompute']}.",
        f"{'Derived' if args.device == 'roofline' else 'Measured'}: {', '.join(measured) or 'nothing'}. From the model "
        "config: layers, kv_bytes, qo_bytes, heads.",
        f"{', '.join(TWO_GPU_KEYS)}: not measured (one GPU; they need two GPUs or nodes), kept from {base_name}.",
        f"Also kept from {base_name}: {', '.join(kept)} (see each key's note).",
        "",
        "Per layer, a micro-batch of documents s_i on one rank takes  a*sum(s_i^2) + b*sum(s_i) + c  seconds.",
    ]
    if fit is not None:
        header += [f"Fit: {len(points)} points (forward + backward of one block, median of {args.repeats} after "
                   f"{args.warmup} warmup), non-negative least squares on relative error; residuals rms "
                   f"{fit.rms:.1%}, max {max(abs(r) for r in fit.relative_residuals):.1%}:",
                   f"  {'documents':>16} {'tokens':>7} {'sum_sq':>11} "
                   f"{'roofline ms' if args.device == 'roofline' else 'measured ms':>12} {'fit ms':>9} "
                   f"{'residual':>8} {'spread':>7}"]
        for p, r in zip(points, fit.relative_residuals, strict=True):
            header.append(f"  {p.label():>16} {p.tokens:>7} {p.sum_sq:>11.4g} {p.seconds * 1e3:>12.3f} "
                          f"{fit.predict(p.sum_sq, p.tokens) * 1e3:>9.3f} {r:>+8.1%} {p.spread:>7.1%}")
    else:
        header.append(f"Fit: not done, {len(points)} points measured within --budget-s {args.budget_s:g} (3 needed).")
    if "head" in found:
        _, times, toks = found["head"]
        header.append("Head (embedding + final norm + LM head + loss, fwd + bwd; the fastest call of each, in turn): "
                      + ", ".join(f"{n} tokens {t * 1e3:.3f} ms" for n, t in zip(toks, times, strict=True)))
    header += memory_text
    if found["skipped"]:
        header.append(f"Skipped: {'; '.join(found['skipped'])}.")
    header.append("")
    return values, notes, header, fit
