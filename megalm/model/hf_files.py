"""Reading a local Hugging Face model directory: its config.json as a megalm model config, and its safetensors
(one file or an index of shards) as megalm's full-model weights, by hf.py's mapping. Pickle weights are refused:
loading them runs arbitrary code. megalm-import and `model.init_from=hf:DIR` read a directory so.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from megalm.config import ModelConfig
from megalm.errors import InteropError
from megalm.model.gpt import GPT, VOCAB_PARAMS, resize_vocab_rows
from megalm.model.hf import INDEX, PICKLE_SUFFIXES, SINGLE, hf_to_megalm, model_config_from_hf

log = logging.getLogger("megalm")


def _load(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file), device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise InteropError(f"{file} is not a readable safetensors file ({str(e).strip()[:200]})") from None


def read_safetensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a transformers model dir: sharded (model.safetensors.index.json) or one file. Pickle
    weights (pytorch_model.bin, ...) are refused: loading them runs arbitrary code."""
    index = hf_dir / INDEX
    if (hf_dir / SINGLE).is_file():  # transformers reads it first: an index beside it is a stale sharded save's
        if index.is_file():
            log.warning(f"{hf_dir} holds {SINGLE} and {INDEX}: {SINGLE} is read, as transformers reads it; delete "
                        "the one that is stale")
        return _load(hf_dir / SINGLE)
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not a mapping")
        except (ValueError, KeyError, TypeError) as e:
            raise InteropError(f"{index} is not a safetensors index ({type(e).__name__}); re-save the model") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (hf_dir / f).is_file()]
        if missing:
            raise InteropError(f"{hf_dir}: {INDEX} names {missing[0]}, which is missing"
                               f"{f' (+{len(missing) - 1} more)' if len(missing) > 1 else ''}; copy every shard")
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            tensors.update(_load(hf_dir / f))
        absent = [k for k in weight_map if k not in tensors]
        if absent:
            raise InteropError(f"{hf_dir}: {INDEX} maps {absent[0]} to {weight_map[absent[0]]}, which lacks it")
        return tensors
    found = sorted(p.name for p in hf_dir.glob("*.safetensors"))
    if len(found) == 1:
        return _load(hf_dir / found[0])
    if found:
        raise InteropError(f"{hf_dir} holds {len(found)} .safetensors files but no {INDEX}; "
                           "add the index transformers wrote with them")
    pickles = sorted(p.name for p in hf_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise InteropError(f"{hf_dir} holds only pickle weights ({pickles[0]}); megalm reads safetensors only "
                           "(pickle can run code): re-save with save_pretrained(..., safe_serialization=True)")
    raise InteropError(f"{hf_dir} holds no model weights ({SINGLE} or {INDEX}); pass a transformers model dir")


def read_hf_config(hf_dir: str | Path) -> tuple[str, ModelConfig, dict]:
    """(architecture, megalm model config with its defaults resolved, config.json) of a local transformers model
    dir, without reading its weights: `model.init_from=hf:DIR` checks the shape first."""
    hf_dir = Path(hf_dir).expanduser().absolute()
    if not hf_dir.is_dir():
        raise InteropError(f"{hf_dir} is not a directory; pass a local Hugging Face model dir (no downloads)")
    config_file = hf_dir / "config.json"
    if not config_file.is_file():
        raise InteropError(f"{hf_dir} has no config.json; pass a transformers model dir (save_pretrained's output)")
    try:
        hf = json.loads(config_file.read_text())
    except ValueError as e:
        raise InteropError(f"{config_file} is not valid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise InteropError(f"{config_file} is a JSON {type(hf).__name__}, not a model config; pass a transformers "
                           "model dir")
    try:
        arch, cfg = model_config_from_hf(hf, str(hf_dir))
    except KeyError as e:
        raise InteropError(f"{config_file} lacks {e}, which this architecture needs; re-save the model with "
                           "save_pretrained (it writes every key)") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise InteropError(f"{config_file} holds a value of the wrong type ({type(e).__name__}: "
                           f"{str(e).splitlines()[0][:150]}); re-save the model with save_pretrained") from None
    return arch, GPT(cfg, device="meta").cfg, hf


def read_hf_model(hf_dir: str | Path) -> tuple[str, ModelConfig, dict[str, torch.Tensor], dict]:
    """(architecture, megalm model config, megalm full-model weights in fp32 with the model's padded vocab rows,
    config.json) of a local transformers model dir. `model.init_from=hf:DIR` and megalm-import read it so."""
    hf_dir = Path(hf_dir).expanduser().absolute()
    arch, cfg, hf = read_hf_config(hf_dir)
    tensors = read_safetensors(hf_dir)
    model = GPT(cfg, device="meta")  # parameter names and shapes only
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    weights = hf_to_megalm(tensors, model.cfg, arch, shapes, str(hf_dir))
    for name in VOCAB_PARAMS:
        if name in weights:
            weights[name] = resize_vocab_rows(weights[name][: cfg.vocab_size], shapes[name][0])
    return arch, model.cfg, weights, hf
