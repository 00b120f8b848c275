"""Reading a checkpoint's metadata and checking its files before a resume: a damaged file, another model or a
changed data order is a one-line error naming the file or the setting, and `trainer.resume=auto` falls back to
the newest intact checkpoint. Another precision loads (checkpoints hold fp32 weights, whatever the recipe), with
one warning line naming what changed."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from omegaconf import OmegaConf

from megalm.config import ModelConfig, config_to_dict, model_config, resolve_model_defaults
from megalm.config.checks import ROPE_SCALING_FIELDS, schema_default
from megalm.config.schema import MoEConfig, RopeScalingConfig
from megalm.errors import CheckpointError, ConfigError
from megalm.model.rope import yarn_attention_factor
from megalm.precision import recipe_on_bf16_weights, skipped_layers
from megalm.training.checkpoint.layout import (
    CHECKPOINTS,
    FORMAT_VERSION,
    LATEST,
    checkpoint_name,
    is_complete,
    latest_checkpoint,
    resolve_checkpoint_path,
    step_dirs,
)
from megalm.training.optim import lr_at

log = logging.getLogger("megalm")


@dataclass
class LoadedCheckpoint:
    path: Path
    state: dict[str, Any]
    config: dict[str, Any]


def saved_model_config(meta: LoadedCheckpoint) -> ModelConfig:
    """The model a checkpoint's config.yaml describes (its defaults resolved); one line naming the file where this
    megalm cannot build it (a key it lacks: a newer megalm's checkpoint, or a value outside a choice)."""
    try:
        return resolve_model_defaults(model_config(meta.config.get("model", {})))
    except ConfigError as e:
        reason = str(e).removeprefix("model config: ").split(";")[0]
        raise CheckpointError(f"checkpoint {meta.path / 'config.yaml'} describes a model this megalm cannot build "
                              f"({reason}); read it with the megalm version that wrote it") from None


def _damaged(file: Path, why: str) -> CheckpointError:
    # generate, export and model.init_from read checkpoints too: the fix names no training key; a run's step_* dir
    # has earlier ones beside it, an imported or init_from checkpoint none
    step = next((p for p in file.parents if p.name.startswith("step_")), None)
    beside = f" (an earlier step_* dir beside {step})" if step is not None else ""
    return CheckpointError(f"checkpoint file {file} is damaged ({why}); use another checkpoint{beside}")


def _check_safetensors(file: Path) -> None:
    """A safetensors file is an 8-byte header length, a JSON header, then exactly the data it describes: a
    truncated file or another kind of file fails this without reading any tensor."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= min(size - 8, 1 << 27):
            raise _damaged(file, "not a safetensors file")
        try:
            header = json.loads(f.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            raise _damaged(file, "not a safetensors file: its header is not safetensors JSON") from None
    if 8 + n + end != size:
        raise _damaged(file, f"truncated: {size} bytes, its header describes {8 + n + end}")


def _read_text_file(file: Path, parse: Any) -> Any:
    try:
        return parse(file.read_text())
    except Exception as e:  # noqa: BLE001 - I/O, decoding, JSON and YAML errors all mean "damaged"
        first = str(e).strip().splitlines()[0][:120] if str(e).strip() else ""
        raise _damaged(file, f"{type(e).__name__}: {first}") from None


def read_checkpoint_meta(path: Path) -> LoadedCheckpoint:
    """state.json and config.yaml of a checkpoint; a one-line error naming the file when one cannot be read."""
    state = _read_text_file(path / "state.json", json.loads)
    if not isinstance(state, dict):
        raise _damaged(path / "state.json", f"a JSON {type(state).__name__}, not a checkpoint's state")
    config = _read_text_file(path / "config.yaml",
                             lambda text: OmegaConf.to_container(OmegaConf.create(text), resolve=True))
    if not (isinstance(config, dict) and isinstance(config.get("model"), dict)):
        raise _damaged(path / "config.yaml", "no model section: not a run's config")
    if state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format version {state.get('format_version')}, "
                              f"this megalm reads {FORMAT_VERSION}")
    return LoadedCheckpoint(path=path, state=state, config=config)  # type: ignore[arg-type]


def verify_checkpoint(path: Path) -> LoadedCheckpoint:
    """Refuse (one line naming the file) a checkpoint whose files were damaged after it was written: an
    unreadable state.json or config.yaml, a truncated or foreign .safetensors file, and (checkpoints since
    2026-12-04, whose state.json lists the files their save wrote) a file missing, of another size, or added.
    Reads headers only; returns the metadata it read."""
    meta = read_checkpoint_meta(path)
    present = {file.name: file for file in sorted(path.glob("*.safetensors"))}
    for file in present.values():
        _check_safetensors(file)
    written = meta.state.get("files")
    if isinstance(written, dict):
        for name, size in written.items():
            if name not in present:
                raise _damaged(path / name, "missing: the save wrote it, and without it DCP would leave that "
                                            "rank's rows unread")
            if present[name].stat().st_size != size:
                raise _damaged(path / name, f"{present[name].stat().st_size} bytes, the save wrote {size}")
        for name in sorted(set(present) - set(written)):
            raise _damaged(path / name, "not written by this checkpoint's save (DCP would read it too); move it "
                                        "out of the checkpoint dir")
    return meta


def latest_unless_never(run_dir: Path, resume: str) -> Path | None:
    """The run dir's latest checkpoint (None: it has none); refused under trainer.resume=never, which would write over
    it (megalm-train's pre-check and the trainer both ask)."""
    latest = latest_checkpoint(run_dir)
    if resume == "never" and latest is not None:
        raise CheckpointError(f"run dir {run_dir} already has checkpoints ({latest.name}); use trainer.resume=auto "
                              "to continue it or choose a new hydra.run.dir")
    return latest


def resumes_as_named(resume: str, path: Path) -> bool:
    """Whether `path`, what `resumable_checkpoint` chose, is the checkpoint trainer.resume=PATH names, not the run
    dir's own checkpoints that a requeued job continues instead (PATH may be gone by then)."""
    try:
        return resume != "auto" and path.resolve() == resolve_checkpoint_path(resume).resolve()
    except CheckpointError:  # gone or incomplete since
        return False


def resumable_checkpoint(run_dir: Path, resume: str) -> Path | None:
    """The checkpoint `trainer.resume` names, checked by `verify_checkpoint`. A path: that checkpoint, or a one-line
    error naming its damaged file; once the run dir has checkpoints of its own (a requeued job), those, whether the
    path is still there or not. "auto": the run dir's `latest`, or, when its files are damaged, the newest older
    complete checkpoint that is intact (a warning names what was skipped); None when the run dir has none."""
    if resume != "auto":
        own = latest_checkpoint(run_dir)
        if not Path(resume).expanduser().exists() and own is None:
            raise CheckpointError(f"trainer.resume={resume}: no such path; set trainer.resume=auto, never, or the "
                                  "path of a checkpoint or run dir")
        try:
            path = resolve_checkpoint_path(resume)
        except CheckpointError:
            if own is None:
                raise
            path = None  # gone, or half pruned: the source run went on (keep_last)
        if own is not None and (path is None or Path(run_dir).resolve() not in path.resolve().parents):
            # a requeued or restarted job: PATH started it, its own checkpoints continue it (TorchTitan's
            # initial_load_path, read only while the run has none), whether PATH is there or not
            (log.info if path is not None else log.warning)(
                f"trainer.resume={resume} not used{'' if path else ' (it is no checkpoint now)'}: run dir {run_dir} "
                f"has checkpoints of its own ({own.name}); continuing them as trainer.resume=auto does")
            return resumable_checkpoint(run_dir, "auto")
        if verify_checkpoint(path).state.get("weights_only"):
            raise CheckpointError(f"checkpoint {path} holds weights only (megalm-import); start from it with "
                                  f"model.init_from={path} instead of trainer.resume")
        return path
    latest = latest_checkpoint(run_dir)
    pointer = Path(run_dir) / CHECKPOINTS / LATEST
    named = pointer.read_text().strip() if pointer.is_file() else ""
    if named and (latest is None or latest.name != named):  # `latest` names only published checkpoints
        if latest is None:
            raise CheckpointError(f"checkpoint {pointer.parent / named}, which {pointer} names, is incomplete (its "
                                  "state.json, config.yaml or shard files are gone) and the run dir has no other; "
                                  "move the run dir away to start over, or resume from a copy with "
                                  "trainer.resume=PATH")
        log.warning(f"checkpoint {pointer.parent / named}, which {pointer} names, is incomplete (its state.json, "
                    f"config.yaml or shard files are gone); trainer.resume=auto falls back to {latest.name}")
    if latest is None:
        return None
    older = [p for p in reversed(step_dirs(latest.parent)) if p.name < latest.name and is_complete(p)]
    for candidate in [latest, *older]:
        try:
            verify_checkpoint(candidate)
            return candidate
        except CheckpointError as e:
            log.warning(f"{e}; trainer.resume=auto falls back to the previous complete checkpoint")
    raise CheckpointError(f"every checkpoint in {latest.parent} is damaged (see the warnings above); move them "
                          "away to start over, or resume from a copy with trainer.resume=PATH")


def check_resume_target(path: Path, step: int, trainer: Any, run_dir: Path, explicit: bool, note: bool = True
                        ) -> None:
    """Refuse to resume checkpoint `path` (at `step`) when the run would end before it starts (`trainer`: the run's
    trainer config), or, for an explicit trainer.resume=PATH (auto takes the run dir's latest intact one), when
    `run_dir` holds complete checkpoints after `step`: the run's saves would replace them. A checkpoint past
    trainer.stop_at_step is said (`note`), not refused: a requeued chunk of a run that went on since trains nothing."""
    if step > trainer.max_steps:
        raise CheckpointError(f"checkpoint {path} is at step {step}, past trainer.max_steps={trainer.max_steps}; raise "
                              "trainer.max_steps to continue it")
    if note and trainer.stop_at_step is not None and step > trainer.stop_at_step:  # it said only "stopped early"
        log.warning(f"checkpoint {path} is at step {step}, past trainer.stop_at_step={trainer.stop_at_step}: nothing "
                    "to train (raise trainer.stop_at_step to continue it)")
    later = [p.name for p in step_dirs(Path(run_dir) / CHECKPOINTS)
             if p.name > checkpoint_name(step) and is_complete(p)] if explicit else []
    if later:
        raise CheckpointError(f"run dir {run_dir} has checkpoints after step {step} ({later[-1]}), which this run "
                              "would overwrite; continue the latest with trainer.resume=auto, or resume step "
                              f"{step} into a new hydra.run.dir")


SHAPE_KEYS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size", "norm",
              "activation", "position_embedding", "tie_embeddings", "bias", "max_position_embeddings")
# keys added to the model config after checkpoints were written: a checkpoint without one had the default
LATER_SHAPE_KEYS = {"qk_norm": False, "qkv_bias": False}
MOE_SHAPE_KEYS = {"num_experts": 0, "expert_ffn_hidden_size": None, "num_shared_experts": 0,
                  "shared_ffn_hidden_size": None, "first_k_dense": 0, "every_n_layers": 1}


def model_structure(model: dict[str, Any]) -> dict[str, Any]:
    """What fixes a model's tensors, from its config section (a checkpoint's or this run's): head_dim as resolved
    (None: hidden_size / num_heads), the MoE layers' keys where the model has experts."""
    out = {k: model.get(k) for k in SHAPE_KEYS} | {k: model.get(k, d) for k, d in LATER_SHAPE_KEYS.items()}
    out["qkv_bias"] = bool(out["qkv_bias"] or out["bias"])  # model.bias puts them there too: the same tensors
    if out["position_embedding"] != "learned":
        del out["max_position_embeddings"]  # sizes only the learned position table: a RoPE model continues at a
        # longer context (it was refused for a shape no tensor has)
    heads = model.get("num_heads")
    out["head_dim"] = model.get("head_dim") or (model.get("hidden_size") // heads if heads else None)
    moe = model.get("moe") or {}
    if moe.get("num_experts", 0) and not moe.get("first_k_dense", 0) and moe.get("every_n_layers", 1) == 1:
        del out["ffn_hidden_size"]  # every block has experts: no tensor has the dense width (an HF export's is the
        # experts' width, and a run from it was refused for a width nothing holds)
    if moe.get("num_experts", 0):
        out |= {f"moe.{k}": moe.get(k, d) for k, d in MOE_SHAPE_KEYS.items()}
    else:
        out["moe.num_experts"] = 0
    return out


def check_model_config(saved: dict[str, Any], current: dict[str, Any], path: Path,
                       fix: str = "use the matching model=... overrides or a new hydra.run.dir") -> None:
    """Refuse a checkpoint written by a model of another shape, naming the differing keys (DCP reads what this
    model asks for: a tensor of the checkpoint it has no place for, a qk-norm weight or a shared expert, would be
    left out without a word). `fix`: what the line tells the user to do (a resume's, by default)."""
    was, now = model_structure(saved), model_structure(current)
    diffs = [f"{k}={was.get(k)} (this run: {now.get(k)})" for k in dict.fromkeys([*was, *now])
             if was.get(k) != now.get(k)]
    if diffs:
        raise CheckpointError(f"checkpoint {path} is from another model: {', '.join(diffs)}; {fix}")


# Not part of the shape check, but they change the function the weights compute: named in a warning (model.init_from
# and a resume)
FUNCTION_KEYS = ("rope_theta", "rope_scaling.type", "rope_scaling.factor", "rope_scaling.low_freq_factor",
                 "rope_scaling.high_freq_factor", "rope_scaling.original_max_position_embeddings",
                 "rope_scaling.beta_fast", "rope_scaling.beta_slow", "rope_scaling.attention_factor",
                 "rope_scaling.truncate", "norm_eps", "sliding_window",
                 "moe.top_k", "moe.norm_topk_prob", "moe.router_score",
                 "moe.routed_scaling_factor")  # moe.*: how an MoE router routes (the model's own experts only)
# ... and what a resume continues to train with (a fine-tune from another model's weights changes them at will)
TRAINING_KEYS = ("dropout", "attention_dropout", "moe.capacity_factor", "moe.drop_policy")


def _model_key(model: dict[str, Any], key: str) -> Any:
    """`key` of a model config dict; `moe.x` inside its moe section (None on a dense model), `rope_scaling.x` inside
    its rope_scaling section (a config from before it: type none; its other values None while the type is none)."""
    section, _, name = key.rpartition(".")
    if section == "moe":
        moe = model.get(section) or {}
        if not moe.get("num_experts") or name == "drop_policy" and moe.get("capacity_factor") is None:
            return None  # a dense model's, or a dropless one's drop policy: nothing reads it
        return str(moe.get(name, schema_default(MoEConfig, name))) if name == "drop_policy" else moe.get(name)
    if section == "rope_scaling":  # the fields its type reads; one a config predates has its default
        scaling = model.get(section) or {}
        kind = str(scaling.get("type", "none"))
        if name == "type":
            return kind
        if name not in ROPE_SCALING_FIELDS[kind]:
            return None
        value = scaling.get(name, schema_default(RopeScalingConfig, name))
        if name == "attention_factor" and value is None:  # the factor's own: the same function as naming it
            factor = scaling.get("factor", schema_default(RopeScalingConfig, "factor"))
            value = yarn_attention_factor(RopeScalingConfig(type=kind, factor=factor))
        return value
    return model.get(key)


def function_differences(source: dict[str, Any], run: dict[str, Any], keys: tuple[str, ...] = FUNCTION_KEYS,
                         ) -> list[str]:
    """`key=value (this run: value)` for each of `keys` on which two model config dicts differ."""
    return [f"{k}={_model_key(source, k)} (this run: {_model_key(run, k)})" for k in keys
            if _model_key(source, k) != _model_key(run, k)]


def note_function_change(saved: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    """One warning line when a resume changes what the model computes or trains with, beyond its shapes (a mistyped
    model.rope_theta): it loads, and the losses part from the run it continues."""
    diffs = function_differences(saved, current, FUNCTION_KEYS + TRAINING_KEYS)
    if saved and diffs:
        log.warning(f"checkpoint {path} was trained with model.{', model.'.join(diffs)}; it loads, and trains on "
                    "another function unless they are set back")


def data_order(cfg: Any, blend: Any) -> dict[str, Any]:
    """What fixes the samples of every step (of a MegalmConfig, and the data's resolved `blend`: [[weight, prefix],
    ...]): a resumed run must have the same (`check_same_data_order`; data.path may name the same data elsewhere)."""
    t, d = cfg.trainer, cfg.data
    synthetic = config_to_dict(d.synthetic) if str(d.name) == "synthetic" else None
    # under a token budget a step's samples are as many as fit it: the batch size is not read (nor compared)
    # (a ramp that starts at the whole batch takes the steps no ramp takes: the same order)
    ramp = list(t.rampup_batch_size) if t.rampup_batch_size and t.rampup_batch_size[0] != t.global_batch_size else None
    batch = {"global_batch_size": t.global_batch_size, "rampup_batch_size": ramp} if t.tokens_per_step is None else {}
    return {"seed": cfg.seed, **batch, "varlen": d.varlen,
            "tokens_per_step": t.tokens_per_step, "blend": blend, "data": str(d.name),
            "path": d.path if str(d.name) == "indexed" else None,
            "seq_length": cfg.model.seq_length, "split_seed": d.split_seed, "valid_fraction": d.valid_fraction,
            "synthetic": synthetic}


def data_size(train: Any, valid: Any) -> dict[str, list[int]]:
    """The documents and tokens of the run's data (both splits): a checkpoint keeps them, so that a resume on data
    rebuilt in place (the same data.path, other contents) is said (`note_data_change`)."""
    splits = [split for split in (train, valid) if split is not None]
    return {"data_size": [sum(int(s.num_docs) for s in splits), sum(int(s.num_tokens) for s in splits)]}


def _moved(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """["path"] when data.path differs from the checkpoint's for the same data: its documents and tokens
    (`data_size`) named by another path (relative, linked, copied to a node's local disk). A blend's prefixes are
    compared as they are: its size is the sum over components, the same for its components reordered, which is
    another order."""
    moved = "path" in saved and saved["path"] != current["path"] and saved.get("blend") == current.get("blend")
    same_size = saved.get("data_size") is not None and list(saved["data_size"]) == list(current["data_size"])
    return ["path"] if moved and same_size else []


def note_data_change(saved: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    """One warning line when the run's data holds other documents than the checkpoint's (a dataset rebuilt under the
    same data.path): the run goes on, but its later samples and validation split are not the ones it would have had;
    one when the same data is read from another path. `current`: the run's `data_order` and `data_size`. A checkpoint
    without the record (before 2026-12-06) is not compared."""
    for key in _moved(saved, current):
        log.warning(f"checkpoint {path} was trained on {key}={saved[key]}, this run reads {current[key]}: resumed as "
                    "the same data read from another place (only the data's contents and settings fix its order)")
    was, now = saved.get("data_size"), current["data_size"]
    if was is not None and list(was) != list(now):
        log.warning(f"checkpoint {path} was trained on data of {was[0]:,} documents and {was[1]:,} tokens, this run's "
                    f"has {now[0]:,} and {now[1]:,}: the data changed since, so the later samples and the validation "
                    "split are not those the run would have seen (set data.path back to the data it trained on)")


def check_same_data_order(saved: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    """Refuse to resume with settings that would change which samples later steps see (seed, batch size, ...). A key
    the checkpoint lacks was added to megalm after it was written: not compared. `current`: the run's `data_order`
    and `data_size`; the same data read from another path is not refused (`note_data_change` says it), nor are its
    contents compared here (a dataset rebuilt in place: said there too)."""
    moved = _moved(saved, current)
    if "global_batch_size" in saved:  # written before rampup_batch_size was recorded (2026-12-07): none ramped
        saved = {"rampup_batch_size": None, **saved}
    for key, value in current.items():
        if key in saved and saved[key] != value and key not in (*moved, "data_size"):
            raise CheckpointError(f"checkpoint {path} was trained with {key}={saved.get(key)}, this run has {value}; "
                                  "resuming would change the data order — set it back or start a new hydra.run.dir")


def check_same_optimizer(saved: dict[str, Any], optimizer: Any, path: Path) -> None:
    """Refuse a checkpoint whose optimizer (`optim.name`) is not this run's: Muon keeps one momentum a matrix where
    AdamW keeps two moments, so the state cannot carry over (DCP said "Missing key ...::momentum_buffer", which
    reads as a corrupt checkpoint). A checkpoint from before the key trained AdamW."""
    was = str(saved.get("optim", {}).get("name", "adamw"))
    now = "muon" if any(group.get("muon") for group in getattr(optimizer, "param_groups", [])) else "adamw"
    if was != now:
        raise CheckpointError(f"checkpoint {path} was trained with optim.name={was}, this run has optim.name={now}: "
                              f"their optimizer states differ; set it back to resume, or start a new hydra.run.dir "
                              f"from its weights with model.init_from={path}")


SCHEDULE_KEYS = ("lr", "min_lr", "schedule", "warmup_steps", "decay_steps", "wsd_decay_fraction", "wsd_decay_style")


def note_schedule_change(saved: dict[str, Any], current: Any, step: int, path: Path, batches: Any = None) -> None:
    """One warning line when this run's learning-rate schedule (the optim keys `lr_at` reads, trainer.max_steps)
    differs from the checkpoint's, with the learning rate of the next step under each: a resume continues this run's
    curve (a longer max_steps re-stretches a cosine; the jump was not said). `batches`: the run's steps, whose ramp
    (a resume keeps it: the data order) the schedule counts in samples."""
    was_optim, was_max = saved.get("optim", {}), saved.get("trainer", {}).get("max_steps")
    now_optim, now_max = current.optim, current.trainer.max_steps
    diffs = [f"optim.{k}={was_optim[k]} (this run: {getattr(now_optim, k)})" for k in SCHEDULE_KEYS
             if k in was_optim and was_optim[k] != getattr(now_optim, k)]
    if was_max is not None and was_max != now_max:
        diffs.append(f"trainer.max_steps={was_max} (this run: {now_max})")
    if diffs:
        as_saved = SimpleNamespace(**{k: was_optim.get(k, getattr(now_optim, k)) for k in SCHEDULE_KEYS})
        was_lr = lr_at(step, as_saved, was_max or now_max, batches)
        now_lr = lr_at(step, now_optim, now_max, batches)
        log.warning(f"checkpoint {path} was trained with {', '.join(diffs)}: step {step + 1} runs at learning rate "
                    f"{now_lr:.4g} on this run's schedule, {was_lr:.4g} on the checkpoint's; set them back to "
                    "continue its curve")


def note_precision_change(saved: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    """One warning line when this run's precision section differs from the checkpoint's, the working weights'
    dtype compared as resolved (`precision.bf16_weights` auto; a checkpoint from before the key trained fp32
    weights): it loads, but trains on as it did only with those keys set back."""
    def resolved(section: dict[str, Any], before_the_key: bool) -> dict[str, Any]:
        unset = False if before_the_key else None  # before the key, the recipes trained fp32 weights
        as_set = SimpleNamespace(**{**section, "bf16_weights": section.get("bf16_weights", unset)})
        skip = skipped_layers(SimpleNamespace(name=section.get("name"), skip=section.get("skip")))  # None: default
        return {**section, "bf16_weights": recipe_on_bf16_weights(as_set), "skip": skip}

    was, now = resolved(saved, before_the_key="bf16_weights" not in saved), resolved(current, before_the_key=False)
    # a key the checkpoint's section lacks was added to megalm after it: only bf16_weights has a rule for that
    diffs = [f"precision.{k}={was.get(k)} (this run: {now.get(k)})" for k in now
             if (k in saved or k == "bf16_weights") and was.get(k) != now.get(k)]
    if saved and diffs:
        log.warning(f"checkpoint {path} was trained with {', '.join(diffs)}; it loads (its weights are fp32), and "
                    "trains on as it did with those keys set back")
    if now.get("name") == "fp8_delayed" and now.get("backend") == "te":
        log.warning("precision=fp8_delayed precision.backend=te: Transformer Engine keeps the amax histories in its "
                    "layers' extra state, which a checkpoint does not hold (TE pickles it, and megalm loads no "
                    "pickle): they start afresh, as a new run's, where the native backend restores its own")
