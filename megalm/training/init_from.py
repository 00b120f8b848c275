"""`model.init_from`: start a run from existing weights instead of its seed's initial ones.

    model.init_from=hf:DIR   a local Hugging Face Llama / GPT-2 directory (read directly, as megalm-import would)
    model.init_from=PATH     a megalm checkpoint or run dir (e.g. megalm-import's output): its weights only

Why weights only: a fresh run (step 0, new optimizer, its own schedule and data order) that continues
pretraining from a model trained elsewhere. The source's config is checked against the run's first (another
shape is refused before any weight is read). A megalm checkpoint is then read as a resume reads one (DCP: each rank
reads its own slices, whatever layout wrote it); a Hugging Face dir one full tensor at a time, each cut to this
rank's slice (the path `init_weights` takes) and let go, so no rank holds the whole source model: any
TP/PP/FSDP/ZeRO-1 layout starts from it. Only the first `vocab_size` embedding/head rows are real, so a source
padded for another TP degree fits too.

`read_megalm_weights` (a megalm checkpoint's full model on CPU) is megalm-export's reader too; the Hugging Face
side (`read_hf_weights`) is megalm/model/hf_files.py's.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from megalm.config import ModelConfig
from megalm.data.blend import tokenizer_identity
from megalm.data.tokenizer import HFTokenizer
from megalm.errors import ConfigError
from megalm.model.gpt import VOCAB_PARAMS, resize_vocab_rows
from megalm.model.hf import model_config_dict
from megalm.model.hf_files import read_hf_config, read_hf_weights
from megalm.model.naming import canonical_named_buffers, canonical_named_parameters
from megalm.model.shard import copy_full_value, shard_specs
from megalm.training.checkpoint import (
    LoadedCheckpoint,
    check_model_config,
    function_differences,
    load_model_weights,
    load_saved_model,
    read_checkpoint_meta,
    resolve_checkpoint_path,
    saved_model_config,
    verify_checkpoint,
)
from megalm.training.optim import full_precision_weights

if TYPE_CHECKING:  # annotations only: the trainer passes its mesh
    from megalm.parallel.dims import ParallelMesh

log = logging.getLogger("megalm")
HF_PREFIX = "hf:"


def validate_init_from(spec: str | None) -> None:
    """One-line ConfigError for a `model.init_from` that cannot name weights (before they are read)."""
    if spec is None:
        return
    if not isinstance(spec, str) or not spec.strip() or spec.strip() == HF_PREFIX:
        raise ConfigError(f"model.init_from={spec!r} is empty; use hf:DIR (a Hugging Face model dir) or the path "
                          "of a megalm checkpoint (e.g. megalm-import's output)")
    path = Path(spec[len(HF_PREFIX):] if spec.startswith(HF_PREFIX) else spec).expanduser()
    if not path.exists():
        raise ConfigError(f"model.init_from={spec}: {path} does not exist; use hf:DIR or a megalm checkpoint path")
    if not spec.startswith(HF_PREFIX) and (path / "config.json").is_file() and not (path / "config.yaml").exists():
        raise ConfigError(f"model.init_from={spec} is a Hugging Face model dir (config.json); write "
                          f"model.init_from=hf:{spec}")


def read_megalm_weights(path: str | Path, buffers: bool = False
                        ) -> tuple[LoadedCheckpoint, ModelConfig, dict[str, torch.Tensor]]:
    """The full model's weights of a megalm checkpoint (or run dir: its `latest`) on CPU, whatever layout wrote
    it (TP/PP/ZeRO-1: DCP reshards into one process), with the model config from its config.yaml; with `buffers`,
    its persistent buffers too (an MoE router's learned selection bias, which the model computes with)."""
    meta, model = load_saved_model(path)
    tensors = {name: p.detach() for name, p in canonical_named_parameters(model)}
    return meta, model.cfg, tensors | ({name: b.detach() for name, b in canonical_named_buffers(model)}
                                       if buffers else {})


@dataclass(frozen=True)
class InitSource:
    """What `model.init_from` names, read before its weights: checked against the run first."""

    where: str  # for the log line
    path: Path
    model: dict[str, Any]  # its model config, as a checkpoint's config.yaml holds it
    tokenizer: str | None  # its tokenizer spec; None where it records none
    hf_config: tuple[str, ModelConfig, dict] | None = None  # a Hugging Face dir's, as `read_hf_config` read it


def read_init_source(spec: str) -> InitSource:
    """The source `model.init_from` names, from its config files alone (a source of another shape is refused before
    every rank reads its whole model into host memory)."""
    validate_init_from(spec)
    if spec.startswith(HF_PREFIX):
        hf_dir = Path(spec[len(HF_PREFIX):]).expanduser().absolute()
        hf_config = read_hf_config(hf_dir)
        arch, cfg, _ = hf_config
        tokenizer = str(hf_dir / "tokenizer.json") if (hf_dir / "tokenizer.json").is_file() else None
        return InitSource(f"Hugging Face {arch} dir {hf_dir}", hf_dir, model_config_dict(cfg), tokenizer, hf_config)
    meta = read_checkpoint_meta(resolve_checkpoint_path(spec))
    cfg = saved_model_config(meta)
    return InitSource(f"checkpoint {meta.path} (step {meta.state.get('step')})", meta.path, model_config_dict(cfg),
                      meta.state.get("tokenizer"))


def copy_init_weights(spec: str, source: InitSource, model: nn.Module, vocab: int,
                      mesh: ParallelMesh | None = None) -> None:
    """Fill `model` (this rank's layout; collective over `mesh` when it is distributed) from the source that was
    checked (a run dir's `latest` as it was then, though the run saves on): a megalm checkpoint's weights and
    persistent buffers, read as a resume reads them; a Hugging Face dir's weights, one tensor at a time."""
    if spec.startswith(HF_PREFIX):
        _copy_init_weights(spec, read_hf_weights(source.path, source.hf_config)[2], model, vocab)
    else:  # a damaged file is one line naming it: DCP would leave a lost rank's rows at their initial values
        verify_checkpoint(source.path)
        load_model_weights(source.path, model, mesh)


def check_same_tokenizer(spec: str, source: str | None, run: str | None) -> None:
    """Refuse (one line) weights trained on another tokenizer's ids than the run's data: the run would go on
    training, with no error, on token ids that mean other text to the model. Compared by content: the files'
    bytes (`tokenizer_identity`), else their vocabularies (a file saved again by another version of the tokenizers
    library); not checked when either side records none (synthetic data, an HF dir without tokenizer.json) or a
    tokenizer file is not on this machine (said in one line)."""
    if source is None or run is None:
        return
    a, b = tokenizer_identity(source), tokenizer_identity(run)
    if a == b:
        return
    if not all(x == "byte" or x.startswith("sha256:") for x in (a, b)):
        log.info(f"model.init_from={spec}: its tokenizer {source} and the data's {run} are not both on this "
                 "machine; not compared")
        return
    if "byte" not in (a, b) and HFTokenizer(source).token_ids() == HFTokenizer(run).token_ids():
        return
    raise ConfigError(f"model.init_from={spec} was trained with tokenizer {source}, this run's data is tokenized with "
                      f"{run}; train on data preprocessed with its tokenizer (megalm-preprocess --tokenizer "
                      f"{source}, data=indexed data.path=PREFIX)")


@torch.no_grad()
def load_init_weights(spec: str, model: nn.Module, run_model: dict[str, Any], optimizer: Any = None,
                      run_tokenizer: str | None = None, mesh: ParallelMesh | None = None) -> str:
    """Copy the weights `spec` names into `model` (a GPT or this rank's pipeline chunks, any layout: every rank of
    `mesh` calls it), checking the source model's shape against `run_model` (the run's model config dict) and its
    tokenizer against the data's (`run_tokenizer`, a spec); with bf16 weights, into the fp32 main weights
    `optimizer` keeps behind them. Returns a log description."""
    source = read_init_source(spec)
    check_model_config(source.model, run_model, source.path, fix="set the run's model.* to the source's "
                       "(megalm-import prints them for a Hugging Face dir), or start from another model.init_from")
    check_same_tokenizer(spec, source.tokenizer, run_tokenizer)
    differing = function_differences(source.model, run_model)
    if differing:
        log.warning(f"model.init_from: the source differs in {', '.join(differing)}; its weights will compute "
                    "another function — set them to match unless that is intended")
    with full_precision_weights(optimizer):
        copy_init_weights(spec, source, model, run_model["vocab_size"], mesh)
    return source.where


def _copy_init_weights(spec: str, weights: Mapping[str, torch.Tensor], model: nn.Module, vocab: int) -> None:
    """Every parameter of `model` from the full-model `weights`, read one at a time: this rank's shard of it (a
    Hugging Face model has no buffers: they keep their initial values)."""
    specs = shard_specs(model)
    for name, param in canonical_named_parameters(model):
        if name not in weights:
            raise ConfigError(f"model.init_from={spec}: the source has no {name}; it is from another model")
        shard = specs.get(name)
        full = weights[name]
        if name in VOCAB_PARAMS:
            full = resize_vocab_rows(full[:vocab], shard.full_shape[0] if shard else param.shape[0])
        if tuple(full.shape) != (shard.full_shape if shard else tuple(param.shape)):
            raise ConfigError(f"model.init_from={spec}: {name} has shape {tuple(full.shape)}, this run's model "
                              f"{shard.full_shape if shard else tuple(param.shape)}; use the matching model config")
        copy_full_value(param, shard.shard(full) if shard else full)  # an FSDP shard takes its own rows
