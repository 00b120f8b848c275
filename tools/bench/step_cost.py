"""What one training step of a model costs on a GPU, traced on a CPU: kernels, bytes moved, FLOPs and a roofline
time per category, for megalm and for Hugging Face's LlamaForCausalLM of the same shape, side by side.

    python tools/bench/step_cost.py model=1.3b model.seq_length=4096            # the table
    python tools/bench/step_cost.py model=1.3b model.seq_length=4096 --json     # one JSON object
    python tools/bench/step_cost.py model=tiny --gpu h200

Each system runs under `FakeTensorMode` (sizes, no data: a 1.3B step traces in seconds) with a dispatch mode that
records every aten op (megalm/measure/op_cost.py). One "step" is one micro-batch of `model.seq_length` tokens,
forward and backward; the optimizer step is its own row: the gradient clipping at norm 1.0 each system runs in
training (megalm's `trainer.grad_clip`, HF Trainer's `max_grad_norm`, TorchTitan's `max_norm`) and AdamW (torch's fused
kernel; megalm's one-pass Triton kernel behind bf16 working weights, as a CUDA run steps them, traced as the op
`megalm::adamw_step`). Systems:
- `megalm`: megalm's `Trainer.forward_backward` at its default precision for the run (`precision=bf16` unless
  overridden: bf16 working weights behind fp32 main weights), eager.
- `megalm_autocast`: the same with `precision=bf16_autocast` (fp32 weights under bf16 autocast: megalm's bf16
  before the fast-step work, and what HF's row runs), when the `megalm` row is bf16.
- `hf_llama`: transformers' LlamaForCausalLM with fp32 weights under bf16 autocast (what HF's Trainer does with
  `bf16=True`), SDPA attention, its own shifted-label loss; for bf16 runs only (left out with a line otherwise).
- `torchtitan`, `torchtitan_compiled`: its llama3 Transformer as compare.py builds it (fp32 weights under bf16
  autocast, its single-device mixed precision), eager and with its blocks and loss compiled, when the version
  tools/compare_peers.txt pins is installed, else left out with a line saying so. Under `precision=fp8` its linears
  are converted by its Float8 converter (torchao's Float8Linear, tensorwise scaling, the output head left in bf16),
  as compare.py runs TorchTitan's fp8, and traced as that GPU runs them (the converter's sm89 check answered for
  `--gpu`); torchao's FP8 tensor subclass is priced by the kernels its dispatch runs (`torch._scaled_mm`, the casts).
- `megalm_compiled`: the `megalm` row with `trainer.compile=true`: each block compiled by inductor, whose
  scheduler gives the kernels it generates and their bytes (megalm/measure/compiled_cost.py); the GEMMs and
  attention it calls as extern kernels are traced as in eager. On a CPU inductor generates C++ kernels in place
  of the GPU's Triton ones, from the same fusion decisions. Under `precision=fp8` and `fp8_delayed` the casts are in
  the block's graph and the GEMMs are megalm's ops, priced by their FLOPs (megalm/measure/op_cost.py); the other
  FP8/MX recipes run each linear, casts included, as one opaque op, and the row is left out with a line saying so.

`--torch-estimator` traces the megalm row's micro-batch once more, priced by torch's own roofline (its
RuntimeEstimator, which reads the live GPU; on a CPU it is given `--gpu`'s datasheet) beside megalm's, op by op
(megalm/measure/torch_roofline.py).

The trace runs on fake CPU tensors, so the dispatcher picks CPU kernels: SDPA's CPU flash kernel stands in for
CUDA's, and ops CUDA runs fused may appear decomposed (both systems alike); megalm's FP8 recipes are traced as the
GPU runs them (its compiled casts, `torch._scaled_mm` from sm89: `compat.fp8_traced_as_gpu`). The roofline time
of an op is max(FLOPs / the tensor-core peak of its dtype, bytes / HBM bandwidth) on `--gpu`; it ignores launch
overhead and overlap, so it is a floor, useful for comparing systems, not a prediction of step time.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from megalm import compat  # noqa: E402
from megalm.errors import ConfigError  # noqa: E402
from megalm.estimate.rank import trace_compiled_blocks  # noqa: E402
from megalm.measure.compiled_cost import InductorCosts  # noqa: E402
from megalm.measure.op_cost import CATEGORIES, GPUS, OpCosts  # noqa: E402
from megalm.measure.torch_roofline import REASONS, compared_with_torch  # noqa: E402
from megalm.parallel.data_parallel.fused_wgrad import accumulator_problem  # noqa: E402
from megalm.precision import compiles_in_sight  # noqa: E402
from megalm.train import compose_config  # noqa: E402
from megalm.training.compile import compile_blocks, compile_loss, inductor_options  # noqa: E402
from tools.bench.cli import run_main  # noqa: E402

STEP_OVERRIDES = ["data=synthetic", "data.synthetic.num_docs=64", "trainer.global_batch_size=1",
                  "trainer.micro_batch_size=1", "trainer.device=cpu", "trainer.hang_minutes=0",
                  "trainer.init_hang_minutes=0", "logging.tensorboard=false", "precision=bf16"]


@contextlib.contextmanager
def fake_trainer(overrides: list[str], gpu: str | None = None) -> Iterator[Any]:
    """megalm's Trainer for one micro-batch of one document of `model.seq_length` tokens, built and run under
    `FakeTensorMode` (sizes, no data) in a scratch run dir; with `gpu`, FP8 recipes as that GPU runs them
    (compat.fp8_traced_as_gpu: compiled casts, torch._scaled_mm from sm89), else as the CPU emulates them."""
    from megalm.training.trainer import Trainer

    cfg = compose_config(STEP_OVERRIDES + overrides)
    trace_compiled_blocks(cfg)  # trainer.compile=true: inductor's kernels counted, not run on fake tensors
    cfg.data.synthetic.fixed_doc_length = cfg.model.seq_length  # one document filling the micro-batch
    as_gpu = compat.fp8_traced_as_gpu(GPUS[gpu].capability) if gpu else contextlib.nullcontext()
    with tempfile.TemporaryDirectory() as run_dir, FakeTensorMode(allow_non_fake_inputs=True), as_gpu:
        yield Trainer(cfg, run_dir)


def megalm_step(overrides: list[str], gpu: str, system: str = "megalm", compiled: bool = False,
                against_torch: str | None = None) -> dict[str, Any]:
    """megalm's forward+backward of one micro-batch and its optimizer step, traced; `compiled`: its blocks compiled
    by inductor, their generated kernels counted from inductor's scheduler (megalm/measure/compiled_cost.py);
    `against_torch`: one more micro-batch priced by torch's roofline beside megalm's (measure/torch_roofline.py),
    torch's estimator reading the live GPU ("live") or the datasheet of the GPU named."""
    with fake_trainer(overrides, gpu) as trainer:
        inductor = InductorCosts(inductor_options())
        if compiled:  # as trainer.compile=true does, with the backend that counts inductor's kernels
            compile_blocks(trainer.model, inductor)
            compile_loss(trainer.parallel.loss_fn, inductor)
        tf32 = trainer.cfg.precision.tf32
        step, optimizer = OpCosts(GPUS[gpu], tf32), OpCosts(GPUS[gpu], tf32)
        trainer.forward_backward(0)  # a first step, untraced: the optimizer's states and any cache are made once
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        with step, _loss_counted_as_loss(step):
            trainer.forward_backward(1)
        with optimizer:  # as train_step: the clip's scale goes into the AdamW step
            trainer.parallel.clip_grad_norm_(trainer.cfg.trainer.grad_clip, trainer.optimizer)
            trainer.optimizer.step()
        trainer.optimizer.grad_scale = None
        if against_torch:
            given = None if against_torch == "live" else GPUS[against_torch]
            with compared_with_torch(given) as against:
                trainer.forward_backward(2)
    how = (f"compiled blocks and loss: inductor, {len(inductor.graphs)} graphs, "
           f"{sum(g['generated_kernels'] for g in inductor.graphs)} generated kernels (C++ on this CPU)"
           if compiled else "eager")
    precision = str(trainer.cfg.precision.name)
    row = {"system": system, "config": f"precision={precision}, {how}", "precision": precision,
           "model": trainer.cfg.model, "precision_config": trainer.cfg.precision,
           "parallel_config": trainer.cfg.parallel, **step.summary(),
           "optimizer": optimizer.summary()}
    if compiled:
        row["inductor_graphs"] = inductor.graphs
    if against_torch:
        row["torch_estimator"] = against.summary()
    return row


def torch_estimator_lines(summary: dict[str, Any]) -> list[str]:
    """The comparison with torch's roofline (`--torch-estimator`), for the table's reader."""
    rates = summary["torch_rates"]
    lines = [f"torch's roofline (RuntimeEstimator, operator-level-cost-model; its device numbers: "
             f"{summary['source']}), the megalm row's micro-batch again: {summary['torch_ms']:.2f} ms; "
             f"megalm's at torch's rates ({rates['bf16_tflops']:.4g} bf16 TFLOP/s as its compute time implies, "
             f"{rates['hbm_tbytes_per_s']:.3g} TB/s): {summary['megalm_ms_at_torch_rates']:.2f} ms",
             "| ops | calls | megalm ms | torch ms | why they differ |", "| --- | --- | --- | --- | --- |"]
    for reason, row in summary["by_reason"].items():
        lines.append(f"| {reason} | {row['calls']} | {row['megalm_ms']:.3f} | {row['torch_ms']:.3f} | "
                     f"{REASONS.get(reason, 'none: the two must agree')} |")
    lines.append("ops of the same conventions whose times differ: " + ("; ".join(summary["unexplained"]) or "none"))
    return lines


@contextlib.contextmanager
def _loss_counted_as_loss(step: OpCosts) -> Iterator[None]:
    """megalm's loss (megalm.model.loss.TokenLoss, on whichever runner calls it) counted in the `loss` category
    (`OpCosts.call_counted_as`): its chunks are generic ops (max, exp, sum, a gather), which by name alone would count
    as elementwise/other, where torch's `nll_loss` of the other rows is named a loss."""
    from unittest import mock

    from megalm.model.loss import TokenLoss

    call = TokenLoss.__call__

    def counted(self: TokenLoss, *args: Any, **kwargs: Any) -> torch.Tensor:
        return step.call_counted_as("loss", call, self, *args, **kwargs)

    with mock.patch.object(TokenLoss, "__call__", counted):
        yield


@contextlib.contextmanager
def _hf_sees_one_document() -> Iterator[None]:
    """transformers' attention as it runs on real tensors: one document with no padding calls SDPA with
    `is_causal=True` (flash attention skips the masked half). Under fake tensors it cannot read the position ids to
    rule out packed documents, so it builds a [s, s] mask and SDPA computes the whole square, twice the FLOPs of its
    GPU run; the trace's batch is one unpacked document, which is what reading them would find."""
    from unittest import mock

    import transformers.masking_utils as masking

    if not hasattr(masking, "find_packed_sequence_indices"):  # an older transformers: nothing to tell it
        yield
        return
    with mock.patch.object(masking, "find_packed_sequence_indices", lambda position_ids: None):
        yield


def hf_llama_step(model_cfg: Any, gpu: str) -> dict[str, Any]:
    """transformers' LlamaForCausalLM of the same shape (and megalm's padded vocab): fp32 weights, bf16 autocast,
    SDPA; one micro-batch."""
    import transformers

    from megalm.model.hf import LLAMA, hf_config

    same = dataclasses.replace(model_cfg, vocab_size=model_cfg.padded_vocab_size)  # as compare.py runs it
    config = transformers.LlamaConfig(**hf_config(same, LLAMA, "float32", None, None))
    config._attn_implementation = "sdpa"
    with FakeTensorMode(allow_non_fake_inputs=True), _hf_sees_one_document():
        model = transformers.LlamaForCausalLM(config)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        ids = torch.zeros(1, model_cfg.seq_length, dtype=torch.long)
        step, optimizer = OpCosts(GPUS[gpu]), OpCosts(GPUS[gpu])
        for traced in (False, True):  # the first step untraced, as megalm's
            with step if traced else contextlib.nullcontext():
                with torch.autocast("cpu", dtype=torch.bfloat16):  # the loss its forward computes with `labels`
                    logits = model(input_ids=ids, use_cache=False).logits
                    loss = step.call_counted_as("loss", model.loss_function, logits=logits, labels=ids,
                                                vocab_size=config.vocab_size)
                loss.backward()
            with optimizer if traced else contextlib.nullcontext():
                # HF Trainer's max_grad_norm, foreach as on a GPU (torch would take fake tensors per parameter)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
                optim.step()
            optim.zero_grad(set_to_none=True)
    return {"system": "hf_llama", "config": f"transformers {transformers.__version__}, fp32 weights + bf16 "
            "autocast, sdpa", **step.summary(), "optimizer": optimizer.summary()}


@contextlib.contextmanager
def _titan_sees_gpu(capability: tuple[int, int]) -> Iterator[None]:
    """TorchTitan's Float8 converter as it converts on a GPU of `capability`: it refuses below sm89 by asking CUDA,
    which the CPU trace has not (megalm's recipes are traced as the GPU runs them likewise:
    `compat.fp8_traced_as_gpu`). torchao's Float8Linear then calls `torch._scaled_mm` on the fake tensors."""
    from unittest import mock

    import torchtitan.components.quantization.float8 as titan_float8

    with mock.patch.object(titan_float8, "has_cuda_capability", lambda major, minor: capability >= (major, minor)):
        yield


TITAN_PRECISIONS = {"bf16": "fp32 weights + bf16 autocast",
                    "fp8": "its Float8 converter (torchao Float8Linear, tensorwise scaling, output head bf16) "
                           "under bf16 autocast"}


def torchtitan_step(model_cfg: Any, gpu: str, compiled: bool = False, precision: str = "bf16") -> dict[str, Any]:
    """TorchTitan's llama3 Transformer of the same shape, as compare.py builds it and its trainer runs it on one
    GPU: fp32 weights under bf16 autocast (its single-device mixed precision), its fp32 cross entropy summed and
    divided by the tokens, fused AdamW; `precision="fp8"`: its linears swapped by its Float8 converter (torchao's
    Float8Linear, what compare.py runs for fp8). `compiled`: each TransformerBlock and the loss compiled, as its
    `compile.enable` does, by the backend that counts inductor's kernels."""
    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.distributed.utils import clip_grad_norm_
    from torchtitan.models.llama3 import Transformer

    from tools.bench.compare_torchtitan import convert_torchtitan, torchtitan_args, torchtitan_job

    job = torchtitan_job(precision, compile_model=False)
    with FakeTensorMode(allow_non_fake_inputs=True), _titan_sees_gpu(GPUS[gpu].capability):
        model = Transformer(torchtitan_args(model_cfg))  # built in place (to_empty cannot swap in fake tensors)
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device("cpu"))
        convert_torchtitan(model, job)
        loss_fn = build_cross_entropy_loss(job)
        inductor = InductorCosts()
        if compiled:
            for block in model.layers.values():
                block.forward = torch.compile(block.forward, backend=inductor, fullgraph=True)
            loss_fn = torch.compile(loss_fn, backend=inductor)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        ids = torch.zeros(1, model_cfg.seq_length + 1, dtype=torch.long)
        step, optimizer = OpCosts(GPUS[gpu]), OpCosts(GPUS[gpu])
        for traced in (False, True):  # the first step untraced, as megalm's
            with step if traced else contextlib.nullcontext():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = step.call_counted_as("loss", loss_fn, model(ids[:, :-1]), ids[:, 1:]) / model_cfg.seq_length
                loss.backward()
            with optimizer if traced else contextlib.nullcontext():
                clip_grad_norm_(model.parameters(), 1.0, foreach=True)  # its trainer's call, at its max_norm
                optim.step()
            optim.zero_grad(set_to_none=True)
    how = f"compiled blocks and loss: inductor, {len(inductor.graphs)} graphs" if compiled else "eager"
    row = {"system": "torchtitan_compiled" if compiled else "torchtitan",
           "config": f"torchtitan llama3, {TITAN_PRECISIONS[precision]}, sdpa, {how}", **step.summary(),
           "optimizer": optimizer.summary()}
    if compiled:
        row["inductor_graphs"] = inductor.graphs
    return row


def torchtitan_missing() -> str | None:
    """Why TorchTitan's rows are left out (not installed, or not the version compare.py drives); None: traced."""
    from tools.bench.compare_run import pin_problem

    problem = pin_problem("torchtitan")
    return f"{problem}: its rows are left out" if problem else None


def table(rows: list[dict[str, Any]]) -> str:
    """A markdown table: one line per system, then the optimizer steps."""
    head = ("| system | kernels | GB moved | TFLOP | roofline ms | " +
            " | ".join(f"{c} ms" for c in CATEGORIES[:5]) + " |")
    lines = [head, "|" + " --- |" * (5 + 5)]
    for r in rows:
        cats = " | ".join(f"{r['by_category'].get(c, {}).get('ms', 0.0):.2f}" for c in CATEGORIES[:5])
        lines.append(f"| {r['system']} | {r['kernels']} | {r['gbytes']:.1f} | {r['tflop']:.2f} | "
                     f"{r['roofline_ms']:.2f} | {cats} |")
    for r in rows:
        o = r["optimizer"]
        lines.append(f"| {r['system']} optimizer step | {o['kernels']} | {o['gbytes']:.1f} | {o['tflop']:.3f} | "
                     f"{o['roofline_ms']:.2f} |" + " |" * 5)
    return "\n".join(lines)


SYSTEMS = ("megalm", "megalm_compiled", "megalm_autocast", "hf_llama", "torchtitan", "torchtitan_compiled")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="megalm-train overrides (model=1.3b model.seq_length=4096)")
    p.add_argument("--gpu", choices=sorted(GPUS), default="h100")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"a comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--torch-estimator", action="store_true",
                   help="also price the megalm row's micro-batch with torch's roofline (RuntimeEstimator), op by "
                        "op beside megalm's: it reads the live GPU, or without CUDA the datasheet of --gpu")
    args = p.parse_intermixed_args(argv)  # overrides before and after the flags
    logging.getLogger("megalm").setLevel(logging.WARNING)
    systems = args.systems.split(",")
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:  # a typo dropped its row from the table without a word
        raise ConfigError(f"--systems {','.join(unknown)}: not one of {','.join(SYSTEMS)}")
    rows, notes = [], []
    against_torch = None  # torch's estimator reads the live GPU, or on a CPU the datasheet of --gpu
    if args.torch_estimator:
        against_torch = "live" if torch.cuda.is_available() else args.gpu
    if against_torch not in (None, "live"):
        notes.append(f"--torch-estimator: no CUDA device here, so torch's RuntimeEstimator was given {args.gpu}'s "
                     "datasheet numbers: what the two rooflines count is compared, not this GPU's rates")
    with contextlib.redirect_stdout(sys.stderr):  # the trainer's own lines do not mix with the table
        ours = megalm_step(args.overrides, args.gpu, against_torch=against_torch)
        if "megalm" in systems:
            rows.append(ours)
        if "megalm_compiled" in systems and not compiles_in_sight(ours["precision_config"]):
            notes.append(f"megalm_compiled left out for precision={ours['precision']}: compiled blocks run its "
                         "linears as opaque ops with their casts inside (megalm/precision/compiled_linear.py), which "
                         "this trace cannot see")
        elif "megalm_compiled" in systems and not compat.compiles_over_fake_tensors():
            notes.append(f"megalm_compiled left out: torch {torch.__version__}'s dynamo cannot compile over the "
                         "trace's fake tensors (torch 2.11 and later can)")
        elif "megalm_compiled" in systems:
            rows.append(megalm_step(args.overrides, args.gpu, "megalm_compiled", compiled=True))
        if "megalm_autocast" in systems and ours["precision"] == "bf16":
            rows.append(megalm_step([*args.overrides, "precision=bf16_autocast",  # fp32 weights: no main gradients
                                     "parallel.gradient_accumulation_fusion=false"], args.gpu, "megalm_autocast"))
        if "hf_llama" in systems and ours["precision"] in ("bf16", "bf16_autocast"):
            rows.append(hf_llama_step(ours["model"], args.gpu))
        elif "hf_llama" in systems:
            notes.append(f"hf_llama left out for precision={ours['precision']}: its row is bf16 autocast only")
        titan = [name for name in ("torchtitan", "torchtitan_compiled") if name in systems]
        titan_precision = "bf16" if ours["precision"] == "bf16_autocast" else ours["precision"]
        if titan and (why := torchtitan_missing()):
            notes.append(why)
        elif titan and titan_precision not in TITAN_PRECISIONS:
            notes.append(f"torchtitan left out for precision={ours['precision']}: its rows are "
                         f"{' and '.join(TITAN_PRECISIONS)} only")
        elif titan and titan_precision == "fp8" and GPUS[args.gpu].capability < (8, 9):
            notes.append(f"torchtitan left out for precision=fp8 on --gpu {args.gpu}: its Float8 converter needs "
                         "compute capability 8.9+")
        elif titan:
            rows += [torchtitan_step(ours["model"], args.gpu, name.endswith("compiled"), titan_precision)
                     for name in titan]
    if ours["parallel_config"].gradient_accumulation_fusion and accumulator_problem("cpu", fake=True):
        notes.append(f"parallel.gradient_accumulation_fusion: torch {torch.__version__}'s fake tensors cannot run "
                     "CUDA's fp32-accumulating GEMM; its weight gradients are priced as the CPU's fp32 emulation")
    shape = ours["model"]
    header = (f"{shape.name}: {shape.num_layers} layers, hidden {shape.hidden_size}, seq {shape.seq_length}; "
              f"roofline on {GPUS[args.gpu].name}; traced on fake CPU tensors (torch {torch.__version__})")
    for r in rows:
        r.pop("model", None)
        r.pop("precision_config", None)
        r.pop("parallel_config", None)
        for graph in r.get("inductor_graphs", ()):  # (a graph only the untraced first step ran has no replay count)
            if "extern_replayed" in graph and graph["extern_replayed"] != sum(graph["extern"].values()):
                notes.append(f"{r['system']}: a graph's extern kernels {graph['extern']} were replayed as "
                             f"{graph.get('extern_replayed')} ops: its GEMM/attention rows may be off")
    if args.json:
        print(json.dumps({"shape": header, "gpu": args.gpu, "systems": rows, "notes": notes}, indent=1))
    else:
        print(header)
        print(table(rows))
        if "torch_estimator" in ours:
            print("\n".join(torch_estimator_lines(ours["torch_estimator"])))
        for note in notes:
            print(f"note: {note}")
    return 0


if __name__ == "__main__":
    run_main(main)
