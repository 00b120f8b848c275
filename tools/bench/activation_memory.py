"""Saved activation bytes per transformer layer, measured from live storages, against Korthikanti et al.'s formula.

    python tools/bench/activation_memory.py model=1.3b model.seq_length=4096
    python tools/bench/activation_memory.py model=1.3b model.seq_length=4096 --recompute none,selective,full
    python tools/bench/activation_memory.py model=1.3b model.seq_length=4096 parallel.tp=8 \
        parallel.sequence_parallel=true

One rank runs one training step (forward and backward of one micro-batch of `model.seq_length` tokens) under
`FakeTensorMode`, with megalm.measure.LiveStorages counting every storage torch holds. The step is run twice, with L
and 2L layers: the difference of the bytes live when the backward begins (autograd's graph-task id tells it apart),
divided by L, is what one layer saved for its backward, measured, nothing read from megalm's own bookkeeping (a peak
would not do: where the forward peaks moves with L, to the output head's logits or into the loss). It is printed in
units of s·h bytes (s tokens, h hidden size) beside Reducing Activation Recomputation in Large Transformer Models
(Korthikanti et al., 2022), Table 2, for one micro-batch (b = 1) and tensor parallel size t: 34 + 5·a·s/h without
recompute (the 5·a·s/h term is the attention matrices, which flash attention never stores: megalm never does, so the
formula column leaves it out), 34 with their selective recompute, 2 with full (the layer input, in bf16). megalm's
`parallel.recompute=selective` keeps the GEMM, attention and collective outputs and recomputes the elementwise ops,
which is not Korthikanti's selective (theirs recomputes the attention core). Under an FP8/MX recipe the layers'
cached FP8 weight copies are live at the backward's start too: they are weights, not activations, and get a column
of their own. FP8 recipes run as this machine runs them (on a CPU, the emulation), or with `--gpu h100` as that GPU
does (`compat.fp8_traced_as_gpu`: torch._scaled_mm's operands and its weight copies).

With `parallel.tp=N` (and `parallel.sequence_parallel=true`) the step is that of rank 0 of N: the process joins a
fake process group of N ranks (torch's `fake` backend: collectives return at once, which fake tensors need no more
of), builds its TP shard and measures what it keeps; the formula is then Korthikanti's for tensor parallelism,
34/t with sequence parallelism and 10 + 24/t without (full recompute: 2/t and 2).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from megalm.measure import LiveStorages, storage_bytes  # noqa: E402
from megalm.measure.op_cost import GPUS  # noqa: E402
from megalm.train import compose_config  # noqa: E402
from tools.bench.cli import run_main  # noqa: E402
from tools.bench.step_cost import STEP_OVERRIDES, fake_trainer  # noqa: E402  (the same one-micro-batch step)


def formula(mode: str, tp: int, sp: bool) -> float:
    """Korthikanti et al. Table 2 (b = 1, flash attention: no 5as/h term), in s·h bytes per layer."""
    if mode == "full":
        return 2.0 / tp if sp else 2.0
    return 34.0 / tp if sp else 10.0 + 24.0 / tp


def join_fake_group(overrides: list[str]) -> tuple[int, bool]:
    """(tp, sequence parallel) of the overrides; for tp > 1, this process becomes rank 0 of a fake group of tp."""
    import torch.distributed as dist

    from megalm import compat

    cfg = compose_config(STEP_OVERRIDES + overrides)
    tp, sp = cfg.parallel.tp, cfg.parallel.sequence_parallel
    if tp > 1 and not dist.is_initialized():
        compat.init_fake_process_group(0, tp)
    return tp, sp


def weight_copies_bytes(model: object) -> int:
    """Bytes of the FP8 weight copies the precision recipes cache for the optimizer step (`LinearState.
    quantized_weight`) there are now: weights in another format, made in the forward, but not activations. Read
    at the backward's start (dgrad's column-major copies, where torch._scaled_mm runs, are made in the backward).
    Read from the caches to say which storages they are; the probe counted their bytes."""
    from megalm.model.linear import linear_modules
    from megalm.precision.linear import RecipeGemms

    return storage_bytes(quantized for module in linear_modules(model)
                         if isinstance(module.gemm_recipe, RecipeGemms) and module.gemm_recipe.state is not None
                         for _, _, (quantized, _) in module.gemm_recipe.state.weights.values())


def held_at_backward_start(overrides: list[str], gpu: str | None = None) -> tuple[int, int, object]:
    """The bytes live when the backward of one step begins (what the forward saved for it, the logits' share, the
    loss) over those live before the step (weights, optimizer), less the FP8 weight copies, which it returns apart,
    and the model config. With `gpu`, FP8 recipes as that GPU runs them."""
    copies: list[int] = []  # read when the backward begins
    with fake_trainer(overrides, gpu) as trainer, \
            LiveStorages(lambda: copies.append(weight_copies_bytes(trainer.model))) as live:
        live.track(trainer.model.parameters())
        before = live.bytes()
        trainer.forward_backward(0)
        return live.at_backward_start - before - copies[0], copies[0], trainer.cfg.model


def per_layer(overrides: list[str], gpu: str | None = None) -> tuple[float, float, object]:
    """Bytes one layer holds for its backward, and of its FP8 weight copies, from the difference of L and 2L
    layers."""
    layers = compose_config(STEP_OVERRIDES + overrides).model.num_layers
    small, small_copies, model = held_at_backward_start(overrides + [f"model.num_layers={layers}"], gpu)
    large, large_copies, _ = held_at_backward_start(overrides + [f"model.num_layers={2 * layers}"], gpu)
    return (large - small) / layers, (large_copies - small_copies) / layers, model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="megalm-train overrides (model=1.3b model.seq_length=4096)")
    p.add_argument("--recompute", default="none,selective,full", help="parallel.recompute values to measure, comma-"
                   "separated (default none,selective,full)")
    p.add_argument("--gpu", choices=sorted(GPUS), default=None,
                   help="trace FP8 recipes as this GPU runs them (torch._scaled_mm from sm89, compiled casts); "
                        "default: as this machine runs them (on a CPU, the emulation)")
    args = p.parse_intermixed_args(argv)  # overrides before and after the flags
    rows = []
    tp, sp = join_fake_group(args.overrides)
    with contextlib.redirect_stdout(sys.stderr):
        for mode in args.recompute.split(","):
            held, copies, model = per_layer(args.overrides + [f"parallel.recompute={mode}"], args.gpu)
            unit = model.seq_length * model.hidden_size
            rows.append((mode, held / unit, copies / unit))
    print(f"{model.name}: hidden {model.hidden_size}, seq {model.seq_length}, tp {tp}{' + SP' if sp else ''}, one "
          "micro-batch, bytes per layer of rank 0 in units of s·h")
    copies = any(c for _, _, c in rows)  # FP8 weight copies, reported apart from the activations
    header = "| recompute | measured | Korthikanti (flash) | measured / formula |"
    print(header + (" FP8 weight copies |" if copies else ""))
    print("| --- | --- | --- | --- |" + (" --- |" if copies else ""))
    for mode, sh, weights in rows:
        expected = formula(mode, tp, sp)
        print(f"| {mode} | {sh:.2f} | {expected:.4g} | {sh / expected:.2f} |" + (f" {weights:.2f} |" if copies else ""))
    return 0


if __name__ == "__main__":
    run_main(main)
