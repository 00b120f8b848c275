"""precision=bf16: bf16 working weights, fp32 main weights in the optimizer, fp32 gradient sums in the buckets.

Each property is checked against an independent computation: the micro-batches' gradients as autograd hands
them over (a tensor hook, before any accumulation), torch's own AdamW on fp32 copies, and the checkpoint's
files read back with safetensors.
"""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file

from megalm.config import resolve_model_defaults
from megalm.model.fused import fuse_tensors
from megalm.model.naming import canonical_named_parameters
from megalm.parallel.data_parallel.bucket_adamw import BucketAdamW
from megalm.training.optim import full_precision_weights
from megalm.training.trainer import Trainer
from tests.conftest import compose_config

# 4 micro-batches of 2 samples: enough partial sums for bf16 accumulation to lose bits
MICRO = ["trainer.global_batch_size=8", "trainer.micro_batch_size=2"]


def bf16_trainer(path, *overrides: str) -> Trainer:
    return Trainer(compose_config("precision=bf16", *MICRO, *overrides), path)


def main_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    with full_precision_weights(trainer.optimizer):
        return {n: p.detach().clone() for n, p in canonical_named_parameters(trainer.model)}


def test_the_model_trains_bf16_weights_behind_fp32_main_weights(tmp_path):
    trainer = bf16_trainer(tmp_path)
    assert isinstance(trainer.optimizer, BucketAdamW)
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    main = main_weights(trainer)
    assert {t.dtype for t in main.values()} == {torch.float32}
    # the main weights are the fp32 initialisation itself, not its bf16 rounding
    fp32 = Trainer(compose_config("precision=fp32", *MICRO), tmp_path / "fp32")
    for name, p in canonical_named_parameters(fp32.model):
        assert torch.equal(main[name], p.detach()), name
    assert any(not torch.equal(t, t.bfloat16().float()) for t in main.values())
    # and the working copies are their bf16 casts
    for name, p in canonical_named_parameters(trainer.model):
        assert torch.equal(p.detach(), main[name].bfloat16()), name


def test_micro_batch_gradients_are_summed_in_fp32(tmp_path):
    """The buckets hold the fp32 sum of the bf16 gradients autograd produced, one per micro-batch; summing them
    in bf16 (in p.grad, as torch accumulates) would round every partial sum."""
    trainer = bf16_trainer(tmp_path)
    arrived: dict[str, list[torch.Tensor]] = {}
    params = dict(canonical_named_parameters(trainer.model))
    for name, p in params.items():
        p.register_hook(lambda g, name=name: arrived.setdefault(name, []).append(g.detach().clone()))
    _, share = trainer.forward_backward(0)
    assert len(share.micro_batches) == 4
    reducer = trainer.parallel.reducer
    lost_in_bf16 = 0
    for name, p in params.items():
        assert p.grad is None, f"{name}: the gradient left p.grad for the bucket"
        grads = arrived[name]
        assert len(grads) == 4 and {g.dtype for g in grads} == {torch.bfloat16}
        fp32_sum = torch.zeros(p.numel(), dtype=torch.float32)
        bf16_sum = torch.zeros(p.numel(), dtype=torch.bfloat16)
        for g in grads:
            fp32_sum += g.reshape(-1)
            bf16_sum += g.reshape(-1)
        summed = reducer.summed_grad(p).reshape(-1)
        assert summed.dtype == torch.float32
        assert torch.equal(summed, fp32_sum), name
        lost_in_bf16 += int(not torch.equal(summed, bf16_sum.float()))
    assert lost_in_bf16 > 0, "no parameter's bf16 sum differs: the test cannot tell fp32 from bf16 accumulation"


def test_adamw_steps_the_fp32_main_weights_and_refreshes_the_bf16_copy(tmp_path):
    trainer = bf16_trainer(tmp_path, "optim.weight_decay=0.1")
    cfg = trainer.cfg.optim
    trainer.forward_backward(0)
    trainer.parallel.clip_grad_norm_(1e-3)  # a real clip: the coefficient reaches the gradients AdamW reads
    before = main_weights(trainer)
    params = dict(canonical_named_parameters(trainer.model))
    grads = {n: trainer.parallel.reducer.summed_grad(p).clone() for n, p in params.items()}
    seen = []
    trainer.optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(main_weights(trainer)))
    trainer.optimizer.step()
    assert len(seen) == 1 and all(torch.equal(seen[0][n], before[n]) for n in before), "pre-hook: before the step"

    ref = {n: t.clone().requires_grad_() for n, t in before.items()}
    for n, t in ref.items():
        t.grad = grads[n]
    decay = [ref[n] for n, p in params.items() if p.ndim >= 2]
    no_decay = [ref[n] for n, p in params.items() if p.ndim < 2]
    torch_adamw = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                     {"params": no_decay, "weight_decay": 0.0}],
                                    lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)
    torch_adamw.step()
    after = main_weights(trainer)
    for name, p in params.items():
        torch.testing.assert_close(after[name], ref[name].detach(), rtol=0, atol=0, msg=name)
        assert torch.equal(p.detach(), after[name].bfloat16()), f"{name}: bf16 copy not refreshed"
    assert any(not torch.equal(after[n], before[n]) for n in params)


def test_updates_below_a_bf16_step_are_kept(tmp_path):
    """An update smaller than half a bf16 ulp of its weight leaves the bf16 weight as it was; the fp32 main
    weight keeps it, so many of them add up (what training bf16 weights directly loses)."""
    trainer = bf16_trainer(tmp_path, "optim.lr=1e-6", "optim.min_lr=0", "optim.warmup_steps=0",
                           "optim.schedule=constant")
    first = main_weights(trainer)
    bf16_first = {n: p.detach().clone() for n, p in canonical_named_parameters(trainer.model)}
    trainer.train_step(0)
    once = main_weights(trainer)
    moved = [n for n in first if not torch.equal(first[n], once[n])]
    assert moved
    unchanged_bf16 = sum(int(torch.equal(p.detach(), bf16_first[n]))
                         for n, p in canonical_named_parameters(trainer.model) if n in moved)
    assert unchanged_bf16 > 0, "every moved weight changed its bf16 copy: the update is not below a bf16 step"


@pytest.mark.parametrize("extra", [[], ["trainer.async_save=true"]], ids=["sync", "async"])
def test_checkpoints_hold_fp32_main_weights_and_resume_exactly(tmp_path, extra):
    run = ["trainer.max_steps=4", "trainer.save_interval=2", *extra]
    straight = bf16_trainer(tmp_path / "straight", *run).fit()
    step2 = tmp_path / "straight" / "checkpoints" / "step_00000002"
    saved = {k.removeprefix("model/"): v for f in step2.glob("shard-*.safetensors")
             for k, v in load_file(str(f)).items() if k.startswith("model/")}
    saved = fuse_tensors(saved, resolve_model_defaults(compose_config().model))  # stored as their parts
    # resume from step 2 in a fresh run dir: the same losses as the run that never stopped
    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    import shutil

    shutil.copytree(step2, resumed_dir / "checkpoints" / step2.name)
    (resumed_dir / "checkpoints" / "latest").write_text(step2.name + "\n")
    resumed_trainer = bf16_trainer(resumed_dir, *run, "trainer.resume=auto")
    main = main_weights(resumed_trainer)
    assert set(saved) == set(main)
    for name, tensor in saved.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, main[name]), name
    assert any(not torch.equal(t, t.bfloat16().float()) for t in saved.values()), "saved the bf16 copies"
    resumed = resumed_trainer.fit()
    assert [loss for step, loss in resumed.losses] == [loss for step, loss in straight.losses if step > 2]


def test_a_bf16_checkpoint_loads_into_fp32_and_zero1_runs(tmp_path):
    bf16_trainer(tmp_path / "bf16", "trainer.max_steps=2").fit()
    ckpt = tmp_path / "bf16" / "checkpoints" / "step_00000002"
    reference = bf16_trainer(tmp_path / "again", "trainer.max_steps=2", f"model.init_from={ckpt}")
    for overrides in (["precision=fp32"], ["precision=bf16", "parallel.zero1=true"]):
        other = Trainer(compose_config(*MICRO, "trainer.max_steps=2", f"model.init_from={ckpt}", *overrides),
                        tmp_path / "_".join(overrides))
        got, want = main_weights(other), main_weights(reference)
        for name in want:
            assert torch.equal(got[name], want[name]), f"{overrides} {name}"


def test_zero1_in_one_process_steps_like_whole_buckets(tmp_path):
    """ZeRO-1's shard of one rank is the whole bucket: the same bits as the unsharded bf16 optimizer."""
    plain = bf16_trainer(tmp_path / "plain")
    zero1 = bf16_trainer(tmp_path / "zero1", "parallel.zero1=true")
    for step in range(3):
        assert plain.train_step(step).loss == zero1.train_step(step).loss
    a, b = main_weights(plain), main_weights(zero1)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_offload_keeps_the_bf16_weights_on_the_device(tmp_path):
    """The offload store skips the parameters' storages: those of the bf16 working weights, which replaced the fp32
    ones at build time (a linear saves its bf16 weight for the backward; moving it to the host is waste)."""
    trainer = bf16_trainer(tmp_path, "offload.enabled=true", "offload.min_tensor_bytes=0")
    store = trainer.parallel.offload_store
    weights = [p for p in trainer.model.parameters() if p.ndim == 2]
    assert not any(store._offloadable(p.detach()) for p in weights)
    assert store._offloadable(torch.zeros(4, dtype=torch.bfloat16))


def test_accumulating_buckets_hold_zeros_for_what_got_no_gradient():
    """A parameter without a gradient in a step (an unused branch, or an HDP rank with no micro-batch) must read as
    zero, not as the previous step's sum: the buckets are not zeroed between steps, a step's first gradient is
    copied in."""
    from megalm.parallel.data_parallel.reducer import GradReducer

    used, unused = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))
    reducer = GradReducer([used, unused], None, accumulate=True)
    reducer.start_step(2)
    for _ in range(2):
        ((used * 2).sum() + (unused * 3).sum()).backward()
    reducer.finish()
    assert torch.equal(reducer.summed_grad(used), torch.full((3,), 4.0))
    assert torch.equal(reducer.summed_grad(unused), torch.full((2,), 6.0))
    reducer.start_step(1)
    (used * 5).sum().backward()  # `unused` gets nothing this step
    reducer.finish()
    assert torch.equal(reducer.summed_grad(used), torch.full((3,), 5.0)), "the first gradient of a step is copied in"
    assert torch.equal(reducer.summed_grad(unused), torch.zeros(2))
    reducer.start_step(0)  # no micro-batch at all
    reducer.finish()
    assert all(torch.equal(g, torch.zeros_like(g)) for g in reducer.grad_shards())


def test_fp8_recipe_on_bf16_weights_quantizes_bf16(tmp_path, monkeypatch):
    """precision.bf16_weights (auto by default: on for the native backend unless precision.autocast=false): an fp8/mx
    recipe trains bf16 working weights behind fp32 main weights, without autocast, so every recipe GEMM gets bf16
    activations and bf16 weights (under autocast over fp32 weights, bf16_weights=false, the weights and the first
    activations reach it in fp32: the fp32 residual stream); a bad combination is one line."""
    from megalm.errors import ConfigError
    from megalm.precision import linear, working_dtype
    from megalm.training.validation import validate_run

    operands = set()
    fprop = linear.RecipeGemms.fprop
    monkeypatch.setattr(linear.RecipeGemms, "fprop",
                        lambda self, call, x, w, *out: operands.add((x.dtype, w.dtype))
                        or fprop(self, call, x, w, *out))
    bf16, fp32 = torch.bfloat16, torch.float32
    cases = [(["precision=fp8"], {(bf16, bf16)}),  # the defaults
             (["precision=mxfp4"], {(bf16, bf16)}),
             (["precision=fp8", "precision.bf16_weights=true"], {(bf16, bf16)}),
             (["precision=fp8", "precision.bf16_weights=false"], {(fp32, fp32), (bf16, fp32)}),
             (["precision=fp8", "precision.autocast=false"], {(fp32, fp32)})]
    for i, (overrides, expected) in enumerate(cases):
        operands.clear()
        trainer = Trainer(compose_config(*overrides, *MICRO), tmp_path / str(i))
        assert torch.isfinite(torch.tensor([trainer.train_step(step).loss for step in range(3)])).all()
        assert operands == expected, overrides
        on_bf16 = expected == {(bf16, bf16)}
        assert {p.dtype for p in trainer.model.parameters()} == {bf16 if on_bf16 else fp32}, overrides
        assert (isinstance(trainer.optimizer, BucketAdamW) and trainer.optimizer.main is not None) == on_bf16
        weights = "on bf16 working weights," if on_bf16 else "on fp32 weights,"
        assert weights in trainer.precision.note, trainer.precision.note  # the start-up line says which
    for backend in ("te", "torchao"):  # their layers take fp32 weights: auto keeps them
        assert working_dtype(compose_config("precision=fp8", f"precision.backend={backend}").precision) is None
    for bad in (["precision=bf16_autocast"], ["precision=fp8", "precision.backend=te"]):
        with pytest.raises(ConfigError, match="precision.bf16_weights=true applies to the native fp8/mx recipes"):
            validate_run(compose_config(*bad, "precision.bf16_weights=true"))


def test_autocast_false_where_it_cannot_act(caplog):
    """precision.autocast=false under bf16_autocast, or beside bf16_weights=true, ran autocast or bf16 weights with
    no word (until 2026-12-06): refused; under fp32 and bf16, which have no autocast to turn off, said to be unread."""
    from megalm.errors import ConfigError
    from megalm.training.validation import validate_run

    with pytest.raises(ConfigError, match="precision=bf16_autocast is bf16 autocast over fp32 weights"):
        validate_run(compose_config("precision=bf16_autocast", "precision.autocast=false"))
    with pytest.raises(ConfigError, match="precision.bf16_weights=true keeps bf16 weights.*drop one of them"):
        validate_run(compose_config("precision=fp8", "precision.bf16_weights=true", "precision.autocast=false"))
    for recipe in ("fp32", "bf16"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="megalm"):
            validate_run(compose_config(f"precision={recipe}", "precision.autocast=false"))
        assert f"precision.autocast=false is not read by precision={recipe}" in caplog.text
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="megalm"):
            validate_run(compose_config(f"precision={recipe}"))
        assert "autocast" not in caplog.text


def test_a_checkpoint_of_another_precision_resumes_with_one_line_naming_what_changed(tmp_path, caplog):
    """An fp8 run of fp32 weights (precision.bf16_weights=false, the recipes' setting before it became auto) resumed
    with the defaults loads, and one warning line names the key to set back; resumed as it was trained, no line."""
    import shutil

    run = [*MICRO, "trainer.max_steps=2", "trainer.save_interval=1"]
    Trainer(compose_config("precision=fp8", "precision.bf16_weights=false", *run), tmp_path / "old").fit()
    step1 = tmp_path / "old" / "checkpoints" / "step_00000001"
    for name, overrides, line in (("default", [], "precision.bf16_weights=False (this run: True)"),
                                  ("same", ["precision.bf16_weights=false"], None)):
        (tmp_path / name / "checkpoints").mkdir(parents=True)
        shutil.copytree(step1, tmp_path / name / "checkpoints" / step1.name)
        (tmp_path / name / "checkpoints" / "latest").write_text(step1.name + "\n")
        caplog.clear()
        with caplog.at_level("WARNING", logger="megalm"):
            trainer = Trainer(compose_config("precision=fp8", *overrides, *run, "trainer.resume=auto"), tmp_path / name)
        assert trainer.step == 1
        said = [r.getMessage() for r in caplog.records if "was trained with precision." in r.getMessage()]
        assert said == ([] if line is None else [said[0]]) and (line is None or line in said[0]), said


def test_keys_a_checkpoint_predates_are_not_named_as_changes(caplog):
    """A precision section saved before keys were added names only what changed: bf16_weights, which such an fp8
    checkpoint trained as false (fp32 weights), not the keys it lacks."""
    from dataclasses import asdict
    from pathlib import Path

    from megalm.config.schema import PrecisionConfig
    from megalm.training.checkpoint import note_precision_change

    current = {**asdict(PrecisionConfig()), "name": "fp8"}
    with caplog.at_level("WARNING", logger="megalm"):
        # this run's skip is the default (None since 2026-12-05): the head under fp8, nothing under bf16
        note_precision_change({"name": "fp8", "skip": ["output"]}, current, Path("ckpt"))
        note_precision_change({"name": "bf16", "skip": []}, {**current, "name": "bf16"}, Path("ckpt"))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "was trained with precision.bf16_weights=False (this run: True);" in said[0], said
