"""Reading a local Hugging Face model directory: its config.json as a megalm model config, and its safetensors
(one file or an index of shards) as megalm's full-model weights, by hf.py's mapping. Pickle weights are refused:
loading them runs arbitrary code. megalm-import and `model.init_from=hf:DIR` read a directory so.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from megalm.config import ModelConfig
from megalm.errors import InteropError
from megalm.model.gpt import GPT, VOCAB_PARAMS, resize_vocab_rows
from megalm.model.hf import INDEX, PICKLE_SUFFIXES, SINGLE, model_config_from_hf
from megalm.model.hf_tensors import HFWeights
from megalm.model.naming import canonical_named_buffers, canonical_named_parameters, model_parts

log = logging.getLogger("megalm")


# safetensors' dtype names, for a tensor's shape read from a file's header alone (`SafetensorsDir.meta`)
_HEADER_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                  "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                  "BOOL": torch.bool}


_UNREADABLE = (SafetensorError, OSError, ValueError)


def _unreadable(file: Path, error: Exception) -> InteropError:
    return InteropError(f"{file} is not a readable safetensors file ({str(error).strip()[:200]})")


def _open(file: Path) -> Any:
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except _UNREADABLE as e:
        raise _unreadable(file, e) from None


class SafetensorsDir(Mapping[str, torch.Tensor]):
    """Every tensor of a transformers model dir (sharded: model.safetensors.index.json, or one file), read one at a
    time when it is looked up: `model.init_from=hf:DIR` copies each into a rank's model and lets it go, so no rank
    holds the whole model. Opening it reads the files' headers only and checks the dir: pickle weights
    (pytorch_model.bin, ...) are refused, since loading them runs arbitrary code."""

    def __init__(self, hf_dir: Path) -> None:
        files, weight_map = _weight_files(hf_dir)
        self._files = {file: _open(file) for file in files}
        self._file_of = {key: file for file, handle in self._files.items() for key in handle.keys()}  # noqa: SIM118
        absent = [k for k in weight_map if k not in self._file_of]
        if absent:
            raise InteropError(f"{hf_dir}: {INDEX} maps {absent[0]} to {weight_map[absent[0]]}, which lacks it")

    def __getitem__(self, key: str) -> torch.Tensor:
        file = self._file_of[key]
        try:
            return self._files[file].get_tensor(key)
        except _UNREADABLE as e:
            raise _unreadable(file, e) from None

    def __contains__(self, key: object) -> bool:  # (Mapping's would read the tensor)
        return key in self._file_of

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)

    def meta(self) -> dict[str, torch.Tensor]:
        """Every tensor's shape and dtype, from the headers (meta tensors: no data read)."""
        out = {}
        for key, file in self._file_of.items():
            piece = self._files[file].get_slice(key)
            out[key] = torch.empty(piece.get_shape(), dtype=_HEADER_DTYPES.get(piece.get_dtype(), torch.float32),
                                   device="meta")
        return out


def _weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not a mapping")
    except (ValueError, KeyError, TypeError) as e:
        raise InteropError(f"{index} is not a safetensors index ({type(e).__name__}); re-save the model") from None
    return weight_map


def _weight_files(hf_dir: Path) -> tuple[list[Path], dict[str, str]]:
    """The safetensors files of a transformers model dir, as transformers picks them, and the index's weight map
    (empty without one)."""
    index = hf_dir / INDEX
    if (hf_dir / SINGLE).is_file():  # transformers reads it first: an index beside it is a stale sharded save's
        if index.is_file():
            log.warning(f"{hf_dir} holds {SINGLE} and {INDEX}: {SINGLE} is read, as transformers reads it; delete "
                        "the one that is stale")
        return [hf_dir / SINGLE], {}
    if index.is_file():
        weight_map = _weight_map(index)
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (hf_dir / f).is_file()]
        if missing:
            raise InteropError(f"{hf_dir}: {INDEX} names {missing[0]}, which is missing"
                               f"{f' (+{len(missing) - 1} more)' if len(missing) > 1 else ''}; copy every shard")
        return [hf_dir / f for f in files], weight_map
    found = sorted(p.name for p in hf_dir.glob("*.safetensors"))
    if len(found) == 1:
        return [hf_dir / found[0]], {}
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


def read_hf_weights(hf_dir: str | Path, config: tuple[str, ModelConfig, dict] | None = None
                    ) -> tuple[str, ModelConfig, HFWeights, dict]:
    """(architecture, megalm model config, megalm full-model weights in fp32 with unpadded vocab rows, each read
    from the files when it is looked up, config.json) of a local transformers model dir: what
    `model.init_from=hf:DIR` copies into a rank's model one tensor at a time. `config`: `read_hf_config`'s, when
    it was read already."""
    hf_dir = Path(hf_dir).expanduser().absolute()
    arch, cfg, hf = config or read_hf_config(hf_dir)
    tensors = SafetensorsDir(hf_dir)
    shapes = {name: tuple(p.shape) for name, p in GPT(cfg, device="meta").named_parameters()}
    return arch, cfg, HFWeights(tensors, cfg, arch, shapes, str(hf_dir), meta=tensors.meta()), hf


class HFModelParts:
    """A Hugging Face dir's weights as megalm's full model (fp32, fused names, vocab rows padded to the model's), a
    part at a time (a block or a top-level module: `model_parts`): what megalm-import writes, holding one part in
    host memory, not the model. `shapes()` gives each part's parameters on the meta device, for planning before
    anything is read; iterating reads each part from the files."""

    def __init__(self, hf_dir: str | Path) -> None:
        self.arch, self.cfg, self._weights, self.hf = read_hf_weights(hf_dir)
        self._model = GPT(self.cfg, device="meta")
        self._meta = dict(canonical_named_parameters(self._model))
        self.parts = model_parts(self._weights)  # the model's parameters, checked against the files

    def shapes(self) -> Iterator[dict[str, torch.Tensor]]:
        return ({name: self._meta[name] for name in names} for names in self.parts.values())

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for names in self.parts.values():
            yield {name: self._read(name) for name in names}

    def buffers(self) -> dict[str, torch.Tensor]:
        """The model's persistent buffers, which Hugging Face files do not hold (an MoE router's selection bias):
        zero."""
        return {name: torch.zeros(b.shape, dtype=b.dtype) for name, b in canonical_named_buffers(self._model)}

    def _read(self, name: str) -> torch.Tensor:
        value = self._weights[name]
        if name in VOCAB_PARAMS:
            return resize_vocab_rows(value[: self.cfg.vocab_size], self._meta[name].shape[0])
        return value
