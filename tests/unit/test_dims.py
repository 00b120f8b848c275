"""Layout validation and rank coordinates (no processes needed)."""

import pytest
import torch

from megalm.errors import ConfigError
from megalm.parallel.dims import ParallelDims
from megalm.parallel.parallelism import validate_parallel
from tests.conftest import compose_config


def layout(world_size: int, *overrides: str) -> ParallelDims:
    from megalm.config import resolve_model_defaults

    cfg = compose_config(*overrides)
    resolve_model_defaults(cfg.model)
    return validate_parallel(cfg, world_size)


def test_rank_order_is_tp_fastest_then_cp_dp_pp():
    dims = ParallelDims(tp=2, cp=2, dp=2, pp=2)
    assert dims.world_size == 16
    assert dims.coordinates(0) == {"tp": 0, "cp": 0, "dp": 0, "pp": 0}
    assert dims.coordinates(1) == {"tp": 1, "cp": 0, "dp": 0, "pp": 0}
    assert dims.coordinates(2) == {"tp": 0, "cp": 1, "dp": 0, "pp": 0}
    assert dims.coordinates(4) == {"tp": 0, "cp": 0, "dp": 1, "pp": 0}
    assert dims.coordinates(13) == {"tp": 1, "cp": 0, "dp": 1, "pp": 1}


def test_dp_defaults_to_what_is_left():
    assert layout(8, "parallel.tp=2", "trainer.micro_batch_size=2") == ParallelDims(tp=2, dp=4)
    assert layout(4, "parallel.tp=4", "trainer.micro_batch_size=2") == ParallelDims(tp=4, dp=1)


@pytest.mark.parametrize("world, overrides, message", [
    (4, ["parallel.tp=2", "parallel.dp=3"], "world size 4 != tp.pp.cp.dp"),
    (3, ["parallel.tp=2"], "world size 3 is not divisible"),
    (2, ["parallel.tp=2", "model.num_heads=2", "model.num_kv_heads=1", "model.hidden_size=64",
         "model.ffn_hidden_size=63"], "ffn_hidden_size=63 is not divisible"),
    (8, ["parallel.tp=8"], "model.num_heads=4 is not divisible by parallel.tp=8"),
    # the shared experts are split as a dense MLP: a width tp does not divide failed inside the model's build
    (2, ["model=moe_tiny", "parallel.tp=2", "model.moe.num_shared_experts=1", "model.moe.shared_ffn_hidden_size=49"],
     "model.moe.shared_ffn_hidden_size=49 is not divisible by parallel.tp=2"),
    (1, ["parallel.sequence_parallel=true"], "needs parallel.tp>1"),
    (2, ["parallel.tp=2", "parallel.async_tp=true"], "set parallel.sequence_parallel=true"),
    (4, ["trainer.global_batch_size=8", "trainer.micro_batch_size=4"], "not divisible by micro_batch_size.dp=4.4"),
    (2, ["parallel.cp=2", "parallel.cp_comm=a2a", "model.num_kv_heads=1"], "cp_comm=a2a splits each TP rank's 4 "
     "query and 1 kv heads over parallel.cp=2"),
    (4, ["parallel.cp=2", "parallel.tp=2", "parallel.cp_comm=a2a"], "use parallel.cp_comm=ring"),
    (4, ["parallel.cp=4", "parallel.cp_comm=a2a+p2p", "model.num_kv_heads=1"], "a2a\\+p2p finds no all-to-all group"),
    (4, ["parallel.cp=4", "parallel.cp_comm=a2a+p2p", "parallel.cp_a2a_size=3"], "cp_a2a_size=3 must divide"),
    # HDP's default group is a node's ranks: the line blamed the heads (an audit, 2026-12-06)
    (2, ["parallel.hdp=true", "data.varlen=true", "parallel.cp_comm=a2a+p2p"],
     "groups one node's HDP ranks: 8 // tp = 8 by default, which does not divide the HDP domain dp.cp=2; set "
     r"parallel.cp_a2a_size to one of \[2\]"),
    (16, ["parallel.hdp=true", "data.varlen=true", "parallel.cp_comm=a2a+p2p", "parallel.tp=8", "model.num_heads=8",
          "model.num_kv_heads=8"], r"at parallel.tp=8 a node holds one \(8 // tp = 1\); no group of 2 or more"),
    (2, ["parallel.cp=2", "parallel.cp_a2a_size=2"], "set parallel.cp_comm=a2a\\+p2p or remove it"),
    (2, ["parallel.cp=2", "model.attention_dropout=0.1"], "cp_comm=ring has no attention dropout"),
    (6, ["parallel.cp=4"], "world size 6 is not divisible by tp.pp.cp"),
    (1, ["parallel.hdp=true"], "parallel.hdp=true balances documents of different lengths; set data.varlen=true"),
    (1, ["parallel.vpp=2", "parallel.pp_schedule=interleaved"], "needs pipeline parallelism"),
    (2, ["parallel.pp=2", "parallel.vpp=2"], "needs parallel.pp_schedule=interleaved"),
    (2, ["parallel.pp=2", "parallel.pp_schedule=interleaved"], "needs parallel.vpp>1"),
    (4, ["parallel.pp=4", "parallel.vpp=2", "parallel.pp_schedule=interleaved", "model.num_layers=8"],
     "multiple of parallel.pp=4"),
    (2, ["parallel.pp=2", "model.num_layers=3"], r"set parallel.layers_per_stage=\[1, 2\]|not divisible"),
    (2, ["parallel.pp=2", "parallel.layers_per_stage=[1,2]"], "sums to 3, not model.num_layers=2"),
    (1, ["parallel.layers_per_stage=[2]"], "one pipeline stage"),
    (2, ["parallel.pp=2", "parallel.recompute=[full]"], "1 entries for parallel.pp=2"),
    (1, ["parallel.recompute=most"], "'most' is not one of none, full, selective"),
    (1, ["parallel.fsdp=true"], "fsdp=true needs dp.cp > 1 ranks"),
    (2, ["parallel.fsdp=true", "parallel.zero1=true"], "drop parallel.zero1"),
    (2, ["parallel.fsdp=true", "data.varlen=true", "trainer.tokens_per_step=64"],  # an audit's hang, 2026-12-04
     "tokens_per_step with parallel.fsdp=true is not supported"),
    (2, ["model=moe_tiny", "parallel.ep=2", "data.varlen=true", "trainer.tokens_per_step=64"],
     "tokens_per_step with parallel.ep=2 is not supported"),
    (2, ["parallel.fsdp=true", "parallel.hdp=true", "data.varlen=true"], "use parallel.zero1=true with HDP"),
    (4, ["parallel.fsdp=true", "parallel.pp=2", "parallel.pp_schedule=zb"], "use 1f1b or interleaved"),
    (2, ["parallel.fsdp=true", "precision=fp8", "precision.backend=te"], "use precision.backend=native"),
    (4, ["parallel.fsdp=true", "parallel.fsdp_shard_size=3", "trainer.micro_batch_size=2"],
     "fsdp_shard_size=3 must divide dp.cp=4"),
    (2, ["parallel.fsdp_shard_size=2"], "fsdp_shard_size=2 needs parallel.fsdp=true"),
    # shards of one rank: it ran, every rank gathering its whole model through FSDP's hooks (found 2026-12-07)
    (2, ["parallel.fsdp=true", "parallel.fsdp_shard_size=1"], "fsdp_shard_size=1 shards nothing"),
    (2, ["parallel.fsdp_reshard_after_forward=false"], "needs parallel.fsdp=true"),
    (2, ["parallel.fsdp_cpu_offload=true"], "needs parallel.fsdp=true"),
    (2, ["parallel.fsdp_reduce_each_micro_batch=false"], "fsdp_reduce_each_micro_batch=false needs parallel.fsdp=true"),
])
def test_bad_layouts_name_the_fix(world, overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        layout(world, *overrides)
    assert "\n" not in str(info.value)


def test_pipeline_layouts_accepted():
    assert layout(4, "parallel.pp=2", "parallel.tp=2").pp == 2
    assert layout(2, "parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=interleaved",
                  "model.num_layers=4", "trainer.micro_batch_size=2").pp == 2
    assert layout(2, "parallel.pp=2", "parallel.pp_schedule=zb", "parallel.recompute=[full,none]").pp == 2


@pytest.mark.parametrize("overrides, said", [
    (("parallel.pp_schedule=zb",), "parallel.pp_schedule=zb has no effect with parallel.pp=1"),
    (("parallel.cp_comm=a2a",), "parallel.cp_comm=a2a has no effect with parallel.cp=1"),
    (("parallel.pp=2", "parallel.pp_schedule=zb", "parallel.cp_comm=a2a+p2p", "parallel.cp=2"), None),
    # HDP's rings read cp_comm whatever parallel.cp is
    (("parallel.hdp=true", "parallel.cp_comm=a2a+p2p", "parallel.cp_a2a_size=2", "data.varlen=true"), None),
])
def test_a_schedule_or_cp_comm_nothing_reads_is_said(caplog, overrides, said):
    with caplog.at_level("WARNING", logger="megalm"):
        layout(4, "trainer.micro_batch_size=2", *overrides)
    effects = [r.getMessage() for r in caplog.records if "has no effect" in r.getMessage()]
    assert effects == ([said] if said else [])


def test_bucket_settings_fsdp_does_not_read_are_said(caplog):
    with caplog.at_level("WARNING", logger="megalm"):
        layout(2, "parallel.fsdp=true", "trainer.micro_batch_size=2")
        layout(2, "parallel.fsdp=true", "trainer.micro_batch_size=2", "parallel.bucket_size_mb=50",
               "parallel.overlap_param_gather=false")
    unused = [r.getMessage() for r in caplog.records if "FSDP replaces" in r.getMessage()]
    assert len(unused) == 1 and "parallel.bucket_size_mb=50.0, parallel.overlap_param_gather=false" in unused[0]


def test_a2a_p2p_at_cp_1_is_accepted_as_the_other_comms_are():
    """At cp=1 nothing forms a ring: cp_comm=ring or a2a is said to be unread, but a2a+p2p was refused for its group
    size, and the fix named (cp_a2a_size) was refused too."""
    assert layout(1, "parallel.cp_comm=a2a+p2p").cp == 1


def test_tp_checks_only_the_widths_it_splits():
    """A model whose every block has experts holds no dense MLP: its ffn_hidden_size is not split (it was refused);
    qk_norm with kv heads replicated over tp is a layout (tests/dist/test_tensor_parallel.py checks its gradients)."""
    assert layout(3, "model=moe_tiny", "model.num_heads=6", "model.num_kv_heads=3", "model.hidden_size=48",
                  "model.ffn_hidden_size=128", "model.moe.first_k_dense=0", "model.make_vocab_size_divisible_by=48",
                  "parallel.tp=3").tp == 3
    assert layout(2, "model.qk_norm=true", "model.num_kv_heads=1", "parallel.tp=2").tp == 2


def test_kv_heads_split_or_replicated():
    assert layout(2, "parallel.tp=2").tp == 2  # 2 kv heads split over tp=2
    assert layout(4, "parallel.tp=4", "trainer.micro_batch_size=2").tp == 4  # 2 kv heads replicated over tp=4
    with pytest.raises(ConfigError, match="one must divide the other"):
        layout(4, "parallel.tp=4", "model.num_heads=12", "model.num_kv_heads=6", "model.hidden_size=96",
               "trainer.micro_batch_size=2")


def test_context_parallel_layouts_accepted():
    assert layout(2, "parallel.cp=2") == ParallelDims(cp=2)
    assert layout(4, "parallel.cp=2", "parallel.cp_comm=a2a", "trainer.micro_batch_size=2") == ParallelDims(cp=2, dp=2)
    assert layout(8, "parallel.cp=2", "parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true",
                  "parallel.recompute=full") == ParallelDims(tp=2, pp=2, cp=2)
    # a2a counts the heads each TP rank holds: 8 query / 4 kv heads over tp=2 leave 4 / 2, divisible by cp=2
    assert layout(4, "parallel.cp=2", "parallel.tp=2", "parallel.cp_comm=a2a", "model.num_heads=8",
                  "model.num_kv_heads=4").cp == 2
    assert layout(2, "parallel.cp=2", "parallel.cp_comm=a2a", "model.attention_dropout=0.1").cp == 2


def test_fsdp_cpu_offload_needs_a_gpu():
    from megalm.training.validation import validate_run

    cfg = compose_config("parallel.fsdp=true", "parallel.fsdp_cpu_offload=true", "trainer.micro_batch_size=2")
    with pytest.raises(ConfigError, match="on cpu they are there already: drop it"):
        validate_run(cfg, 2, torch.device("cpu"))


def test_fsdp_cpu_offload_gives_host_tensors_a_backend_beside_nccl(monkeypatch, tmp_path):
    """FSDP's host-offloaded gradients (the tied embedding's all-reduce over pipeline stages) are CPU tensors, which
    NCCL does not take: a run with parallel.fsdp_cpu_offload joins with gloo for them beside NCCL, as TorchTitan does.
    On CPU the group's calls are recorded; megalm-train's first join (shared_run_dir) and the trainer's pass it."""
    import torch.distributed as dist

    from megalm.parallel import dims
    from megalm.training import run_dir

    joined = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: joined.append(backend))
    monkeypatch.setattr(dist, "is_initialized", lambda: bool(joined))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    for offload, backend in ((False, "nccl"), (True, "cuda:nccl,cpu:gloo")):
        joined.clear()
        assert dims.init_distributed(torch.device("cuda"), None, host_collectives=offload) == (0, 2)
        assert joined == [backend]
    seen = []
    monkeypatch.setattr(dims, "init_distributed", lambda device, minutes, host: seen.append(host) or (0, 1))
    for offload in (False, True):
        run_dir.shared_run_dir(tmp_path, compose_config(f"parallel.fsdp_cpu_offload={str(offload).lower()}"))
    assert seen == [False, True]


def test_a_restarted_attempt_reads_none_of_its_predecessors_keys(monkeypatch):
    """Under torchrun every restart attempt shares the agent's store; a restarted group that read the gloo addresses
    its dead predecessor wrote hung about one time in four (tests/e2e/test_restarts.py kills and restarts a real run).
    Each attempt's keys live under a prefix of its own restart count."""
    import datetime

    import torch.distributed as dist

    from megalm.parallel import dims
    from tests.dist.launch import free_port

    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False)
    timeout = datetime.timedelta(seconds=10)
    assert dims._attempt_store(2, timeout) is None  # not under torchrun's agent: env:// as it is
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    dead = dims._attempt_store(2, timeout)
    dead.set("rank_0", "the address of a process that is gone")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    restarted = dims._attempt_store(2, timeout)
    assert not restarted.check(["rank_0"]) and dead.check(["rank_0"])
    restarted.set("rank_0", "alive")
    assert restarted.get("rank_0") == b"alive" and dead.get("rank_0") != b"alive"
    del agent
