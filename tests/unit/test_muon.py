"""optim.name=muon (megalm/training/muon.py): each of the blocks' matrices (q, k, v, gate and up apart, each expert
apart) takes torch.optim.Muon's step, the rest torch's AdamW step, and a resumed run repeats the straight one. Layouts
against one process: tests/dist/test_muon.py."""

from __future__ import annotations

import pytest
import torch

from megalm.errors import ConfigError
from megalm.model import GPT
from megalm.model.naming import canonical_named_parameters
from megalm.parallel.data_parallel.bucket_adamw import BucketAdamW
from megalm.training.muon import Muon, orthogonalise
from megalm.training.optim import build_optimizer, full_precision_weights
from megalm.training.trainer import Trainer
from megalm.training.validation import validate_run
from tests.conftest import compose_config


def _random_grads(params: list[torch.nn.Parameter], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)


@pytest.mark.parametrize("model, scale", [("tiny", "match_rms_adamw"), ("moe_tiny", "original")])
def test_three_steps_are_torch_s_muon_on_the_unfused_matrices_and_torch_s_adamw_elsewhere(model, scale):
    """The reference steps each matrix of the unfused model on its own: q, k and v of qkv_proj, gate and up of
    gate_up_proj, each expert's slice, with torch.optim.Muon (its Newton-Schulz in bf16, megalm's in fp32: the
    updates agree to 5%: 2.2% measured, where a wrong scale, a fused matrix orthogonalised whole or a momentum
    without Nesterov's step is off by 10% or more), and the other parameters with torch.optim.AdamW (to the bit)."""
    cfg = compose_config(f"model={model}", "optim.name=muon", f"optim.muon_scale={scale}")
    from megalm.model import GPT

    torch.manual_seed(0)
    model_ = GPT(cfg.model)
    with torch.no_grad():  # (a GPT's construction leaves the grouped experts' weights as torch.empty made them)
        for p in model_.parameters():
            p.normal_(0.0, 0.02)
    optimizer = build_optimizer(model_, cfg.optim)
    assert isinstance(optimizer, Muon)
    muon_group = next(g for g in optimizer.param_groups if g["muon"])
    named = dict(model_.named_parameters())
    matrix_names = [n for n, p in named.items() if any(p is q for q in muon_group["params"])]
    assert matrix_names and all(n.startswith("layers.") and ".router." not in n for n in matrix_names)
    assert not any(n.endswith(("embedding.weight", "output.weight")) for n in matrix_names)

    # the reference: a leaf per matrix of the unfused model, and the other parameters as they are
    pieces: dict[str, list[torch.Tensor]] = {}
    for name in matrix_names:
        layout = optimizer.matrices[id(named[name])]
        mats = [m for part in layout.split(named[name].detach()) for m in (part.unbind(0) if part.ndim == 3 else
                                                                             [part])]
        pieces[name] = [torch.nn.Parameter(m.clone()) for m in mats]
    others = {n: torch.nn.Parameter(p.detach().clone()) for n, p in named.items() if n not in matrix_names}
    o = cfg.optim
    ref_muon = torch.optim.Muon([p for ps in pieces.values() for p in ps], lr=o.lr, weight_decay=o.weight_decay,
                                momentum=o.muon_momentum, nesterov=o.muon_nesterov, ns_steps=o.muon_ns_steps,
                                adjust_lr_fn=scale)
    decay = [p for n, p in others.items() if p.ndim >= 2]
    ref_adamw = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                                   {"params": [p for p in others.values() if p.ndim < 2], "weight_decay": 0.0}],
                                  lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True)
    for step in range(3):
        _random_grads(list(named.values()), step)
        for name, ps in pieces.items():
            layout = optimizer.matrices[id(named[name])]
            grads = [m for part in layout.split(named[name].grad) for m in (part.unbind(0) if part.ndim == 3 else
                                                                             [part])]
            for p, g in zip(ps, grads, strict=True):
                p.grad = g.clone()
        for n, p in others.items():
            p.grad = named[n].grad.clone()
        before = {n: named[n].detach().clone() for n in matrix_names}
        optimizer.step()
        ref_muon.step()
        ref_adamw.step()
        for n, p in others.items():
            assert torch.equal(named[n].detach(), p.detach()), n
        for name in matrix_names:
            layout = optimizer.matrices[id(named[name])]
            ours = [m for part in layout.split(named[name].detach() - before[name])
                    for m in (part.unbind(0) if part.ndim == 3 else [part])]
            for piece, ours_update, was in zip(pieces[name], ours, [m for part in layout.split(before[name])
                                                                    for m in (part.unbind(0) if part.ndim == 3
                                                                              else [part])], strict=True):
                theirs = piece.detach() - was
                error = (ours_update - theirs).norm() / theirs.norm()
                assert error < 5e-2, f"{name} step {step}: the update differs from torch's by {error:.3g}"
            for piece, now in zip(pieces[name], [m for part in layout.split(named[name].detach())
                                                 for m in (part.unbind(0) if part.ndim == 3 else [part])],
                                  strict=True):
                piece.data.copy_(now)  # go on from megalm's weights: each step compared on its own


def test_the_iteration_orthogonalises():
    """Newton-Schulz brings every singular value of a random matrix near 1 (Jordan et al.'s quintic: within about
    [0.7, 1.2] after 5 steps), for wide, tall and stacked matrices alike, keeping the singular vectors."""
    torch.manual_seed(0)
    for shape in [(32, 96), (96, 32), (4, 48, 16)]:
        g = torch.randn(shape)
        o = orthogonalise(g, 5)
        s = torch.linalg.svdvals(o)
        assert s.min() > 0.6 and s.max() < 1.25, (shape, s.min(), s.max())
        u, _, vh = torch.linalg.svd(g, full_matrices=False)
        off = u.mT @ o @ vh.mT
        off = off - torch.diag_embed(off.diagonal(dim1=-2, dim2=-1))
        assert off.abs().max() < 1e-4  # O = U·f(S)·Vᵀ: diagonal in G's singular bases


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_resumed_muon_run_repeats_the_straight_one(tmp_path, precision):
    steps = ["optim.name=muon", "trainer.max_steps=6", "trainer.save_interval=3", "model=moe_tiny",
             f"precision={precision}"]
    straight = Trainer(compose_config(*steps), tmp_path / "straight").fit()
    Trainer(compose_config(*steps, "trainer.stop_at_step=3"), tmp_path / "run").fit()
    resumed = Trainer(compose_config(*steps), tmp_path / "run")
    assert resumed.step == 3 and isinstance(resumed.optimizer, Muon if precision == "fp32" else BucketAdamW)
    assert straight.losses[3:] == resumed.fit().losses


def test_fsdp_is_refused_and_zero1_shards_by_whole_parameters():
    with pytest.raises(ConfigError, match=r"optim.name=muon orthogonalises whole matrices, which parallel.fsdp=true "
                                          r"cuts across the data-parallel ranks; use parallel.zero1=true"):
        validate_run(compose_config("optim.name=muon", "parallel.fsdp=true", "parallel.dp=2"), world_size=2)
    with pytest.raises(ConfigError, match=r"optim.implementation=triton steps AdamW's ZeRO-1 shards; under "
                                          r"optim.name=muon .* use optim.implementation=auto"):
        validate_run(compose_config("optim.name=muon", "parallel.zero1=true", "optim.implementation=triton",
                                    "parallel.dp=2"), world_size=2)
    validate_run(compose_config("optim.name=muon", "parallel.zero1=true", "parallel.dp=2"), world_size=2)


def test_bf16_working_weights_step_their_fp32_main_weights_as_muon_steps_fp32_weights(tmp_path):
    """precision=bf16: the matrices' Muon step runs on BucketAdamW's fp32 main weights (views of its buckets, the
    momentum where AdamW's first moment would be), the rest its AdamW step; three steps from the same fp32 weights
    and summed gradients equal `Muon` on an fp32 model (one with a clip's scale, which the matrices divide by as the
    fused AdamW does), to the bit, and so do the optimizer states; the working weights are the main weights' casts."""
    trainer = Trainer(compose_config("optim.name=muon", "precision=bf16", "model=moe_tiny"), tmp_path)
    optimizer = trainer.optimizer
    assert isinstance(optimizer, BucketAdamW) and optimizer.matrix_groups
    named = dict(canonical_named_parameters(trainer.model))
    assert all(p.dtype == torch.bfloat16 for p in named.values())
    reference = GPT(trainer.cfg.model)
    ref_named = dict(canonical_named_parameters(reference))
    with torch.no_grad(), full_precision_weights(optimizer):
        for name, p in ref_named.items():
            p.copy_(named[name])
    ref_optimizer = build_optimizer(reference, trainer.cfg.optim)
    assert isinstance(ref_optimizer, Muon)
    for step, scale in enumerate([None, 2.0, None]):
        trainer.forward_backward(step)
        for name, p in ref_named.items():
            grad = trainer.parallel.reducer.summed_grad(named[name]).float()
            p.grad = grad.clone() if scale is None else grad / scale
        optimizer.grad_scale = None if scale is None else torch.tensor(scale)
        optimizer.step()
        optimizer.grad_scale = None
        ref_optimizer.step()
        for name, p in named.items():
            assert torch.equal(p, ref_named[name].detach().to(torch.bfloat16)), f"step {step}: working weight {name}"
        with full_precision_weights(optimizer):
            for name, p in named.items():
                torch.testing.assert_close(p, ref_named[name].detach(), rtol=0, atol=0, msg=f"step {step}: {name}")
    ours, theirs = optimizer.state_dict()["state"], ref_optimizer.state_dict()["state"]
    assert ours.keys() == theirs.keys()
    for index, state in theirs.items():
        assert ours[index].keys() == state.keys()
        for key, value in state.items():
            torch.testing.assert_close(ours[index][key], value, rtol=0, atol=0, msg=f"parameter {index} {key}")


@pytest.mark.parametrize("before, after", [("adamw", "muon"), ("muon", "adamw")])
def test_a_resume_under_the_other_optimizer_is_refused_in_one_line(tmp_path, before, after):
    """Their states differ (one momentum a matrix, or two moments): the resume names the key and the way on, where
    DCP's "Missing key ...::momentum_buffer" said the checkpoint was corrupt (a second reader, 2026-12-07)."""
    from megalm.errors import CheckpointError

    Trainer(compose_config(f"optim.name={before}", "trainer.max_steps=2"), tmp_path).fit()
    with pytest.raises(CheckpointError, match=rf"was trained with optim.name={before}, this run has "
                                              rf"optim.name={after}: their optimizer states differ; set it back to "
                                              "resume, or start a new hydra.run.dir from its weights with "
                                              "model.init_from="):
        Trainer(compose_config(f"optim.name={after}", "trainer.max_steps=4"), tmp_path)
