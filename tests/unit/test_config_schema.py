"""The schema documents and types every field: a docstring under each (as TorchTitan's job_config), an Enum for
each fixed set of names that the owning package's list agrees with, and a value outside a choice fails at
composition as one line naming the options."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from megalm import config
from megalm.config import choices
from megalm.config.choices import Choice
from megalm.errors import ConfigError
from tests.conftest import compose_config

SCHEMA = Path(config.schema.__file__)


def field_docstrings() -> dict[str, dict[str, str | None]]:
    """{section class: {field: its docstring, or None}} read from the schema's source."""
    found = {}
    for node in ast.parse(SCHEMA.read_text()).body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields, body = {}, node.body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign):
                nxt = body[i + 1] if i + 1 < len(body) else None
                doc = nxt.value.value if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) else None
                fields[stmt.target.id] = doc
        found[node.name] = fields
    return found


def test_every_field_of_every_section_has_a_docstring():
    docs = field_docstrings()
    sections = [c for c in vars(config.schema).values() if dataclasses.is_dataclass(c) and isinstance(c, type)]
    assert len(sections) >= 10
    missing = [f"{section.__name__}.{f.name}" for section in sections for f in dataclasses.fields(section)
               if not docs[section.__name__].get(f.name)]
    assert not missing, f"fields without a docstring: {missing}"
    assert all(section.__doc__ and "(" not in section.__doc__[:1] for section in sections)


def test_the_docstring_check_sees_a_missing_one(tmp_path, monkeypatch):
    seq_length_doc = '    """Tokens per sample (packed), or the longest document piece (data.varlen)."""\n'
    source = SCHEMA.read_text().replace(seq_length_doc, "", 1)
    assert source != SCHEMA.read_text()
    fake = tmp_path / "schema.py"
    fake.write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "SCHEMA", fake)
    assert field_docstrings()["ModelConfig"]["seq_length"] is None


def test_each_choice_is_an_enum_field_of_the_schema():
    """Every Enum in choices types a schema field, and no string field holds what an Enum should."""
    enums = {e for e in vars(choices).values() if isinstance(e, type) and issubclass(e, Choice) and e is not Choice}
    typed = set()
    for section in (c for c in vars(config.schema).values() if dataclasses.is_dataclass(c) and isinstance(c, type)):
        hints = typing.get_type_hints(section)
        for hint in hints.values():
            typed |= {a for a in getattr(hint, "__args__", (hint,)) if a in enums}
    assert typed == enums, enums - typed


def test_the_packages_name_the_same_choices_as_the_schema():
    from megalm.model.attention import BACKENDS
    from megalm.offload.policy import POLICIES
    from megalm.parallel.context.attention import COMMS
    from megalm.parallel.pipeline.schedules import SCHEDULES, build_schedule
    from megalm.precision import PRECISIONS
    from megalm.precision.recipes import FORWARD_SPECS

    assert set(PRECISIONS) == set(choices.PrecisionRecipe.names()) - {"auto"}
    assert set(choices.ForwardFormat.names()) <= set(FORWARD_SPECS)
    assert choices.PipelineScheduleName.names() == SCHEDULES
    for name in SCHEDULES:  # each name the schema accepts builds a schedule
        assert build_schedule(name, 2, 4, vpp=2 if name == "interleaved" else 1)
    assert choices.ContextComm.names() == COMMS
    assert choices.OffloadPolicy.names() == POLICIES
    assert choices.AttentionBackend.names() == BACKENDS


def test_a_choice_reads_as_its_string():
    schedule = choices.PipelineScheduleName["1f1b"]
    assert schedule == "1f1b" and f"{schedule}" == "1f1b" and str(schedule) == "1f1b"
    assert {"1f1b": 1}[schedule] == 1 and json.dumps(schedule) == '"1f1b"'
    cfg = compose_config("parallel.pp_schedule=zb", "model.norm=layernorm")
    assert cfg.parallel.pp_schedule is choices.PipelineScheduleName.zb and cfg.model.norm == "layernorm"
    plain = config.config_to_dict(cfg)
    assert type(plain["model"]["norm"]) is str and OmegaConf.to_yaml(plain).count("layernorm") == 1


@pytest.mark.parametrize("override, message", [
    ("optim.schedule=exp",
     "optim.schedule=exp is not one of cosine|wsd|linear|constant|inverse_sqrt; pick one of those"),
    ("precision.name=fp4", "precision=fp4 is not one of auto|fp32|bf16|bf16_autocast|fp8|"),
    ("parallel.pp_schedule=gpipe", "parallel.pp_schedule=gpipe is not one of 1f1b|interleaved|zb"),
    ("parallel.grad_reduce_dtype=fp16", "parallel.grad_reduce_dtype=fp16 is not one of fp32|bf16"),
    ("offload.policy=sometimes", "offload.policy=sometimes is not one of uniform|lifespan|auto"),
    ("model.norm=batchnorm", "model.norm=batchnorm is not one of rmsnorm|layernorm"),
])
def test_a_value_outside_a_choice_fails_as_one_line(override, message):
    """Through megalm-train's own pre-check (no run starts) and through a config built from a dict."""
    result = subprocess.run([sys.executable, "-m", "megalm.train", override], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    key, value = override.split("=")
    section, name = key.split(".")
    with pytest.raises(ConfigError, match=message[:20]):
        config.to_dataclass(OmegaConf.create({section: {name: value}}))


def test_a_value_set_in_python_is_still_checked():
    cfg = compose_config()
    cfg.optim.schedule = "exp"
    with pytest.raises(ConfigError, match="optim.schedule=exp is not one of"):
        config.validate(cfg)


@pytest.mark.parametrize("override, message", [
    ("optim.beta1=1.5", "optim.beta1=1.5 must be in [0, 1)"),
    ("optim.beta2=-0.1", "optim.beta2=-0.1 must be in [0, 1)"),
    ("optim.eps=-1", "optim.eps=-1.0 must be a finite number > 0"),
    ("optim.weight_decay=-5", "optim.weight_decay=-5.0 must be a finite number >= 0"),
    ("optim.decay_steps=-3", "optim.decay_steps=-3 must be a finite number > 0"),
    ("trainer.grad_clip=-1", "trainer.grad_clip=-1.0 must be a finite number >= 0 (0 turns clipping off)"),
    # NaN compares false with everything: until 2026-12-04 these passed (an audit found it); grad_clip=nan turned
    # clipping off, lr=nan failed inside torch, an inf lr or init_std trained inf
    ("optim.lr=nan", "optim.lr=nan must be a finite number > 0"),
    ("optim.lr=inf", "optim.lr=inf must be a finite number > 0"),
    ("optim.min_lr=nan", "optim.min_lr=nan must be in [0, optim.lr="),
    ("trainer.grad_clip=nan", "trainer.grad_clip=nan must be a finite number >= 0"),
    ("trainer.hang_minutes=nan", "trainer.hang_minutes=nan must be a finite number >= 0"),
    ("model.init_std=inf", "model.init_std=inf must be a finite number > 0"),
    ("model.head_dim=0", "model.head_dim=0 must be >= 1"),  # 0 read as unset, then a traceback in the model
    ("trainer.spike_window=5", "trainer.spike_window=5 must be >= 10"),  # spike reports silently off
    ("trainer.num_threads=0", "trainer.num_threads=0 must be >= 1, or null"),
    ("trainer.compile_backend=bogus", "trainer.compile_backend=bogus is not one of inductor|aot_eager|eager"),
    ("trainer.resume=", "trainer.resume is empty"),
    ("model.norm_eps=-1", "model.norm_eps=-1.0 must be a finite number > 0"),
    ("model.rope_theta=0", "model.rope_theta=0.0 must be a finite number > 0"),
    ("model.init_std=-1", "model.init_std=-1.0 must be a finite number > 0"),
    ("data.synthetic.num_docs=0", "data.synthetic.num_docs=0 must be a finite number > 0"),
    ("data.synthetic.mean_doc_length=0", "data.synthetic.mean_doc_length=0 must be a finite number > 0"),
    ("data.synthetic.fixed_doc_length=-3", "data.synthetic.fixed_doc_length=-3 must be a finite number > 0"),
    # each passed, then failed inside the data builder or torch with a traceback (an audit, 2026-12-04)
    ("data.synthetic.fixed_doc_length=1", "data.synthetic.fixed_doc_length=1 must be >= 2"),
    ("data.synthetic.mean_doc_length=1", "data.synthetic.mean_doc_length=1 must be >= 2"),
    ("model.vocab_size=1", "data=synthetic draws tokens besides the end-of-document: model.vocab_size=1 must be"),
    ("seed=-1", "seed=-1 must be in [0, 2**63)"),
    ("seed=18446744073709551616", "seed=18446744073709551616 must be in [0, 2**63)"),
    ("data.split_seed=-5", "data.split_seed=-5 must be in [0, 2**63)"),
])
def test_a_value_outside_its_range_fails_as_one_line(override, message):
    """Values the schema's types admit but training cannot use: each was a traceback from inside torch, or a run
    that trained NaNs (or a learning rate 100x the one set) and exited 0."""
    with pytest.raises(ConfigError) as e:
        config.validate(compose_config(override))
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("override, message", [
    ("parallel.recompute=true", "parallel.recompute=True is not one of none, full, selective, nor a list"),
    ("parallel.recompute={selective:1}", "parallel.recompute={'selective': 1} is not one of"),
])
def test_a_recompute_that_is_no_mode_nor_a_list_fails_as_one_line(override, message):
    """A TypeError traceback (true, null, 5), or a mapping read as its keys (an audit, 2026-12-04)."""
    from megalm.training.validation import validate_run

    with pytest.raises(ConfigError) as e:
        validate_run(compose_config(override))
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_schedule_settings_that_cannot_act_are_said(caplog):
    """A warmup as long as the run (the learning rate never decayed), decay_steps or wsd_decay_fraction under a
    schedule that does not read it, and a padded vocab set by hand (derived) were accepted without a word."""
    import logging

    with caplog.at_level(logging.WARNING, logger="megalm"):
        config.validate(compose_config("trainer.max_steps=30", "optim.warmup_steps=40"))
        config.validate(compose_config("optim.schedule=wsd", "optim.decay_steps=50"))
        config.validate(compose_config("trainer.max_steps=30", "optim.warmup_steps=3", "optim.schedule=cosine",
                                       "optim.decay_steps=20"))
        config.validate(compose_config("optim.schedule=wsd", "optim.wsd_decay_fraction=0.5"))
        config.validate(compose_config("optim.schedule=cosine", "optim.wsd_decay_fraction=0.5"))  # the mirror case
        config.validate(compose_config("model.padded_vocab_size=1000"))  # derived: the run pads to 320
        config.validate(compose_config("model.padded_vocab_size=320"))  # what it derives: nothing to say
        config.validate(compose_config("optim.schedule=inverse_sqrt", "optim.wsd_decay_style=minus_sqrt"))
        config.validate(compose_config("optim.schedule=wsd", "optim.wsd_decay_style=minus_sqrt"))
    lines = [r.message for r in caplog.records]
    assert len(lines) == 5, lines
    assert lines[4] == ("optim.wsd_decay_style=minus_sqrt is read by the wsd schedule only: "
                        "optim.schedule=inverse_sqrt decays as the inverse square root of the step")
    assert lines[2] == ("optim.wsd_decay_fraction=0.5 is read by the wsd schedule only: optim.schedule=cosine decays "
                        "over optim.decay_steps (null: to trainer.max_steps)")
    assert lines[3].startswith("model.padded_vocab_size=1000 is derived, not read: the run pads model.vocab_size=320 "
                               "to 320")
    assert lines[0] == ("optim.warmup_steps=40 >= trainer.max_steps=30: the learning rate warms up for the whole run "
                        "(it ends at 75% of optim.lr=0.003) and never decays")
    assert lines[1].startswith("optim.decay_steps=50 is read by the cosine and linear schedules only: "
                               "optim.schedule=wsd decays over optim.wsd_decay_fraction of the run")


BUDGET = ("data=synthetic", "data.varlen=true", "trainer.tokens_per_step=256")


def test_settings_nothing_reads_are_said(caplog):
    """data.synthetic.* beside other data, logging.wandb.* with W&B off, trainer.compile_backend in an eager run,
    parallel.overlap_param_gather without ZeRO-1, trainer.global_batch_size under a token budget, trainer.eval_iters
    without evaluations and trainer.max_consecutive_skips under nonfinite=stop were ignored without a word (until
    2026-12-06); where each is read, nothing is said."""
    import logging

    from megalm.training.validation import validate_run

    said = {
        ("data=demo", "data.synthetic.num_docs=10"): "data.synthetic: num_docs=10 set with data=demo: not used "
                                                      "(data=synthetic reads it)",
        ("logging.wandb.project=mine", "logging.wandb.mode=online"): "logging.wandb: project=mine, mode=online set "
                                                                    "with logging.wandb.enabled=false: not used "
                                                                    "(logging.wandb.enabled=true logs to W&B)",
        ("trainer.compile=false", "trainer.compile_backend=aot_eager"): "trainer.compile_backend=aot_eager is read by "
                                                                        "compiled blocks only, and this run is eager "
                                                                        "(trainer.compile=false, as set or as null "
                                                                        "resolves for it): not used",
        ("parallel.overlap_param_gather=false",): "parallel.overlap_param_gather=false times ZeRO-1's all-gather of "
                                                  "the updated parameters, and parallel.zero1=false gathers none: not "
                                                  "used",
        (*BUDGET, "trainer.global_batch_size=8"): "trainer.global_batch_size=8 set with trainer.tokens_per_step=256: "
                                                  "not used (a step takes the samples that fit the token budget)",
        ("trainer.eval_interval=0", "trainer.eval_iters=9"): "trainer.eval_iters=9 set with trainer.eval_interval=0, "
                                                             "which never evaluates: not used",
        ("trainer.nonfinite=stop", "trainer.max_consecutive_skips=3"): "trainer.max_consecutive_skips=3 set with "
                                                                       "trainer.nonfinite=stop, which skips no step: "
                                                                       "not used",
        # (an audit, 2026-12-06)
        ("model=gpt2_tiny", "model.rope_theta=500000"): "model.rope_theta=500000.0 set with "
                                                        "model.position_embedding=learned, which has no rotary "
                                                        "embedding: not used",
        ("profiling.start_step=3", "profiling.ranks=[1]"): "profiling.start_step=3, profiling.ranks=[1] set with "
                                                           "profiling.trace and profiling.memory_snapshot false, "
                                                           "which profile nothing: not used",
        # a preset on the config's default data, as the cluster examples ran (a newcomer's audit)
        ("model=125m",): "data=demo is the Python standard library as bytes (257 ids), for a model of 50,304 tokens "
                         "(125m): a smoke run, not a language model; tokenize your corpus with megalm-preprocess and "
                         "set data=indexed data.path=PREFIX",
    }
    for overrides, line in said.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="megalm"):
            validate_run(compose_config(*overrides, tiny=False))
        assert caplog.messages == [line], (overrides, caplog.messages)
    read = [("data=synthetic", "data.synthetic.num_docs=10"),  # each read where it is set: nothing to say
            ("parallel.overlap_param_gather=false", "parallel.zero1=true"),
            ("trainer.compile=true", "trainer.compile_backend=aot_eager"), BUDGET, ("trainer.eval_iters=9",),
            ("trainer.max_consecutive_skips=3",), ("model.rope_theta=500000",), ("model=gpt2_tiny",),
            ("profiling.trace=true", "profiling.start_step=3", "trainer.max_steps=10")]
    for overrides in read + [()]:  # and the defaults
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="megalm"):
            validate_run(compose_config(*overrides, tiny=False), world_size=2 if "parallel.zero1=true" in overrides
                         else 1)
        assert not [m for m in caplog.messages if "not used" in m], (overrides, caplog.messages)


def test_the_range_rules_pass_every_shipped_config():
    """The defaults, and every model preset as shipped (no tiny overrides), pass the whole run's validation, FP8's
    skip patterns included: the rules above refuse only what a user set wrong."""
    from megalm.training.validation import validate_run

    for name in sorted(p.stem for p in (Path(config.__file__).parents[2] / "configs" / "model").glob("*.yaml")):
        validate_run(compose_config(f"model={name}", tiny=False))
        validate_run(compose_config(f"model={name}", "precision=fp8", 'precision.skip=["output","layers.{last}.*"]',
                                    tiny=False))


def test_a_precision_skip_pattern_that_names_no_layer_fails_as_one_line():
    """A typo in precision.skip (`outptu`) had quantized the head it meant to keep, without a word."""
    from megalm.training.validation import validate_run

    for pattern in ("outptu", "layers.0.attention", "embedding"):  # a typo; modules that are no linear layer
        with pytest.raises(ConfigError, match=rf"^precision.skip pattern '{pattern}' names no linear layer"):
            validate_run(compose_config("precision=fp8", f"precision.skip=[{pattern}]"))
    validate_run(compose_config("precision=fp8", 'precision.skip=["output","layers.{last}.*","layers.0.mlp.*"]'))
    # a tied head is still `output`: with another pattern beside it, the check builds the model and names it
    validate_run(compose_config("precision=fp8", "model=gpt2_tiny", 'precision.skip=["output","layers.0.*"]'))


def test_the_recipe_by_key_keeps_the_head_as_the_recipe_by_group_does():
    """`precision.name=fp8` (over the default group) had put the head in FP8 where `precision=fp8` kept it in bf16:
    the [output] default lived in the group's YAML only."""
    import torch

    from megalm.model import GPT
    from megalm.precision import Precision
    from megalm.training.validation import validate_run

    for name in ("fp8", "mxfp4"):
        notes = []
        for override in (f"precision={name}", f"precision.name={name}"):
            cfg = validate_run(compose_config(override))
            converter = Precision(cfg.precision, seed=0, device=torch.device("cpu"))
            converter.convert(GPT(cfg.model, device="meta"))
            notes.append(converter.note)
        assert notes[0] == notes[1] and notes[0].endswith("skipping ['output']"), notes


@pytest.mark.parametrize("overrides, message", [
    (["precision=bf16", "precision.bf16_weights=false"], "precision.bf16_weights=false applies to the fp8/mx recipes; "
                                                          "remove it for precision=bf16 (fp32 weights under bf16 "
                                                          "autocast: precision=bf16_autocast)"),
    (["precision=bf16", "precision.skip=[outptu]"], "precision.skip keeps layers out of the fp8/mx recipes"),
    (["precision=fp32", "precision.skip=[output]"], "precision=fp32 has no recipe"),
])
def test_precision_settings_no_recipe_reads_are_refused(overrides, message):
    """Under fp32, bf16 and bf16_autocast `precision.skip` and `precision.bf16_weights=false` were accepted and did
    nothing (a typo in skip was refused under fp8 only)."""
    from megalm.training.validation import validate_run

    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_run(compose_config(*overrides))


@pytest.mark.parametrize("overrides, message", [
    (["precision=fp32"], "which takes bf16 only, and precision=fp32 runs them in fp32; set precision=bf16, or set "
                         "trainer.compile=false"),
    (["precision=fp8", "precision.autocast=false", "precision.bf16_weights=false"],
     "precision=fp8 runs them in fp32; set precision=bf16 or precision.bf16_weights=true, or set "
     "trainer.compile=false"),
    (["precision=bf16", "model.moe.expert_ffn_hidden_size=20"], "multiples of 8): model.moe.expert_ffn_hidden_size=20; "
                                                                "round it to a multiple of 8"),
], ids=["fp32", "fp8_fp32_experts", "width"])
def test_compiled_moe_blocks_the_grouped_gemm_cannot_trace_are_refused(overrides, message):
    """torch._grouped_mm's meta kernel (what a compiled block is traced with) takes bf16 rows of 16 bytes: fp32
    experts under an fp8 recipe without autocast or bf16 weights, and widths that are not multiples of 8, were
    accepted and failed in the first compiled step with a dynamo traceback (precision=fp32 alone was refused)."""
    from megalm.training.validation import validate_run

    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        validate_run(compose_config("model=moe_tiny", "trainer.compile=true", *overrides))
    assert "\n" not in str(error.value)
    validate_run(compose_config("model=moe_tiny", "trainer.compile=true", "precision=bf16"))  # it can trace that


def test_a_composition_is_kept_per_process_and_each_caller_gets_its_own_copy(tmp_path, monkeypatch):
    """megalm.config.compose keeps what it composed (a composition is 0.3-0.6 s of CPU): the same overrides give an
    equal config that the caller may change without changing the next one's, a bad value is refused every time, and
    a config file edited in between is read again."""
    import shutil

    from megalm.config import compose

    first = compose.compose_config(["model.num_layers=3"])
    first.model.num_layers = 7  # the caller's copy
    again = compose.compose_config(["model.num_layers=3"])
    assert again.model.num_layers == 3 and again is not first and again.model is not first.model
    assert again == compose.compose_config(["model.num_layers=3"])
    for _ in range(2):
        with pytest.raises(ConfigError, match="model.num_layers"):
            compose.compose_config(["model.num_layers=many"])
    configs = tmp_path / "configs"
    shutil.copytree(compose.CONFIG_DIR, configs)
    monkeypatch.setattr(compose, "CONFIG_DIR", str(configs))
    assert compose.compose_config([]).model.hidden_size == 256  # configs/model/tiny.yaml
    tiny = configs / "model" / "tiny.yaml"
    tiny.write_text(tiny.read_text().replace("hidden_size: 256", "hidden_size: 128"))
    assert compose.compose_config([]).model.hidden_size == 128


def test_help_lists_the_groups_a_run_can_pick_and_hdp_cost_as_its_key():
    """`megalm-train --help` listed Hydra's groups, every folder of configs/: `hdp_cost: h100_7b, h200_7b` among them,
    which `hdp_cost=h100_7b` refuses (its files are parallel.hdp_cost's values). Each group it lists now composes with
    each option it names, and hdp_cost is named as the key, with the presets the cost model has."""
    import subprocess
    import sys

    from megalm.config.compose import config_groups_help
    from megalm.parallel.hdp.cost import SHAPES, load_cost

    groups, _, key = config_groups_help().partition("\n\n")
    listed = dict(line.split(": ", 1) for line in groups.splitlines())
    assert "hdp_cost" not in listed and {"model", "precision", "data", "parallel"} <= listed.keys(), listed
    for group, options in listed.items():
        for option in options.split(", "):
            compose_config(f"{group}={option}", tiny=False)
    assert key.startswith("and the key parallel.hdp_cost (HDP's cost model): h100_7b, h200_7b (configs/hdp_cost/)")
    presets = key.split("a preset (")[1].split(")")[0].split(", ")
    assert presets == list(SHAPES), presets
    for name in key.split(": ")[1].split(" (configs")[0].split(", "):
        load_cost(name)
    proc = subprocess.run([sys.executable, "-m", "megalm.train", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and groups in proc.stdout and "\nhdp_cost:" not in proc.stdout, proc.stdout[:2000]
