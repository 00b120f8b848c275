"""The peers of tools/bench/compare.py at the versions tools/compare_peers.txt pins: each builds exactly the shape
megalm builds (the same parameter count, built on the meta device), and the SDPA core attention given to
Megatron-Core computes what Megatron's own DotProductAttention does. A peer that is not installed at its pin is
skipped, saying so (the main CI leg has megatron-core from the dev extra and no torchtitan; a torch 2.11 leg
installs the pins); one installed at its pin that does not import or build fails."""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from unittest import mock

import pytest
import torch

from megalm.config import ModelConfig
from megalm.model.gpt import GPT, num_parameters

ROOT = Path(__file__).resolve().parents[2]
META = torch.device("meta")
CPU = torch.device("cpu")


def load_compare() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_compare", ROOT / "tools" / "bench" / "compare.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being made
    spec.loader.exec_module(module)
    return module


compare = load_compare()
from tools.bench import compare_megatron, compare_run, compare_torchtitan  # noqa: E402 - after compare's sys.path

# (model config, Hydra overrides): the shapes compare.py runs by default, GQA at full size, and --tiny.
SHAPES = [("125m", []), ("1.3b", []), ("125m", ["model.num_kv_heads=4"]), ("tiny", [])]


def shape_config(name: str, overrides: list[str]) -> ModelConfig:
    """The model of a compare.py cell, as it builds it (padded vocab included)."""
    cell = compare.Cell(name, 64 if name == "tiny" else 2048, "bf16")
    return compare.cell_config(cell, 1, overrides, tiny=name == "tiny").model


def shape_id(shape: tuple[str, list[str]]) -> str:
    return "-".join([shape[0], *shape[1]])


def pinned(package: str, module: str) -> ModuleType:
    """`module` of `package`, or a skip that says why: not installed, or another version than the pin."""
    problem = compare_run.pin_problem(package)
    if problem:
        pytest.skip(problem)
    return importlib.import_module(module)  # installed at the pin: failing to import is a failure


def test_pins_are_exact_and_the_only_place_versions_are_set(tmp_path):
    pins = compare_run.peer_pins()
    assert {"megatron-core", "torchtitan", "torchao"} <= set(pins)
    script = (ROOT / "tools" / "compare_wheels.sh").read_text()
    assert "-r tools/compare_peers.txt" in script
    assert not re.search(r"(megatron-core|torchtitan|torchao)==", script)  # no second, drifting pin
    ranged = tmp_path / "peers.txt"
    ranged.write_text("# fine\nmegatron-core==0.16.1\ntorchtitan>=0.2\n")
    with pytest.raises(ValueError, match="torchtitan>=0.2"):
        compare_run.peer_pins(ranged)


@pytest.fixture(scope="module")
def megatron_group() -> Iterator[None]:
    """Megatron-Core's one-rank model-parallel state on gloo, torn down after this file if made here."""
    pinned("megatron-core", "megatron.core")
    import torch.distributed as dist
    from megatron.core import parallel_state

    made = not dist.is_initialized()
    compare_megatron.megatron_process_group(CPU)
    yield
    if made:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_megatron_gpt_on_the_sdpa_spec_has_megalms_parameter_count(shape, megatron_group):
    model = shape_config(*shape)
    with compare_megatron.megatron_on_cpu(META):
        gpt = compare_megatron.build_megatron(model, META, seed=0)
    cores = [m for m in gpt.modules() if isinstance(m, compare_megatron.SDPACoreAttention)]
    assert len(cores) == model.num_layers  # every layer's core attention is SDPA, none DotProductAttention
    assert sum(p.numel() for p in gpt.parameters()) == num_parameters(GPT(model, device="meta"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_torchtitan_llama3_has_megalms_parameter_count(shape):
    pinned("torchtitan", "torchtitan.models.llama3")
    model = shape_config(*shape)
    job = compare_torchtitan.torchtitan_job("bf16", compile_model=False)
    titan = compare_torchtitan.build_torchtitan(model, META, 0, job)
    assert titan.layers["0"].feed_forward.w1.weight.shape == (model.ffn_hidden_size, model.hidden_size)
    assert titan.layers["0"].attention.wk.weight.shape[0] == model.num_kv_heads * model.hidden_size // model.num_heads
    assert sum(p.numel() for p in titan.parameters()) == num_parameters(GPT(model, device="meta"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
def test_sdpa_core_attention_matches_megatrons_dot_product_attention(heads, groups, megatron_group):
    """fp32 on a CPU, forward and gradients, against Megatron's unfused DotProductAttention given an explicit
    mask (its default causal mask is made on CUDA): causal with no mask (is_causal), causal with Megatron's
    mask, and no_mask; GQA groups read by query head // (heads / groups) in both."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    head_dim, s, b = 8, 12, 3
    config = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                               num_query_groups=groups, attention_dropout=0.0, hidden_dropout=0.0,
                               masked_softmax_fusion=False, use_cpu_initialization=True)
    no_fork = mock.Mock(fork=mock.MagicMock())  # DotProductAttention forks the CUDA RNG around its dropout (0 here)
    with compare_megatron.megatron_on_cpu(CPU), \
            mock.patch("megatron.core.tensor_parallel.get_cuda_rng_tracker", lambda *a, **k: no_fork):
        reference = DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                        attention_type="self")
        ours = compare_megatron.SDPACoreAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                         attention_type="self")
        generator = torch.Generator().manual_seed(0)
        q = torch.randn(s, b, heads, head_dim, generator=generator)
        k, v = (torch.randn(s, b, groups, head_dim, generator=generator) for _ in range(2))
        grad = torch.randn(s, b, heads * head_dim, generator=generator)
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]  # True: masked out
        visible = torch.zeros_like(causal)

        def run(module, mask, **kwargs):
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            out = module(*inputs, mask, **kwargs)
            out.backward(grad)
            return out, [t.grad for t in inputs]

        expected = run(reference, causal)
        for got in (run(ours, None), run(ours, causal)):
            assert got[0].shape == (s, b, heads * head_dim)
            torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
            for g, e in zip(got[1], expected[1], strict=True):
                torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
        full, _ = run(ours, None, attn_mask_type=AttnMaskType.no_mask)
        torch.testing.assert_close(full, run(reference, visible)[0], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(full, expected[0])  # the mask matters at these shapes: the checks can tell
    assert ours.kernel and ours.kernel != "no kernel"


@pytest.mark.timeout(60)
def test_sdpa_core_attention_refuses_what_it_cannot_run(megatron_group):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True)
    core = compare_megatron.SDPACoreAttention(config, 1, AttnMaskType.padding, "self")
    q = torch.randn(4, 1, 2, 8)
    with pytest.raises(ValueError, match="needs an attention_mask"):
        core(q, q, q, None)
    with pytest.raises(NotImplementedError, match="packed sequences"):
        core(q, q, q, None, packed_seq_params=PackedSeqParams(qkv_format="thd"))


def test_compare_refuses_a_model_the_peers_would_not_compute():
    """Megatron-Core and TorchTitan are built with plain RoPE and no biases: a megalm row under model.rope_scaling or
    model.qkv_bias would compare two models; refused before any run."""
    from megalm.errors import ConfigError

    with pytest.raises(ConfigError, match="drop model.rope_scaling"):
        compare.main(["--tiny", "--seqs", "64", "--precisions", "fp32", "model.rope_scaling.type=llama3"])
    with pytest.raises(ConfigError, match="without biases"):
        compare.main(["--tiny", "--seqs", "64", "--precisions", "fp32", "model.qkv_bias=true"])
