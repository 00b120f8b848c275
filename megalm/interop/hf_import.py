"""`megalm-import`: a local Hugging Face directory (Llama, Mistral, GPT-2, Qwen2, Qwen3, Qwen3-MoE or Mixtral) as a
megalm checkpoint directory.

    megalm-import /tmp/hf-model --out /tmp/imported
    megalm-train model.init_from=/tmp/imported <the model.* overrides it prints> ...

Why: to continue pretraining (or sample from) a `transformers` model under any megalm layout. The result is a
checkpoint dir in megalm's own layout (safetensors shards as DCP reads them, state.json, config.yaml), so
`megalm-generate`, `megalm-export` and `model.init_from` read it like any checkpoint; state.json marks it weights-only
(step 0, no optimizer state: a run started from it builds a fresh optimizer). Weights are stored in fp32 (megalm's
master weights), which is lossless from bf16/fp16 files. They are read and written a block at a time (a shard file
is written once its tensors are read), so host memory holds a block and a file, not the model in fp32. Only
safetensors are read (no pickle) and nothing is downloaded. Directories megalm cannot compute exactly are refused in
one line (see megalm/model/hf.py, which reads the directory).
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import shutil
from itertools import chain
from pathlib import Path

import torch
from omegaconf import OmegaConf

from megalm.config import DataConfig, MegalmConfig, ModelConfig, config_to_dict
from megalm.data.tokenizer import HFTokenizer
from megalm.errors import MegalmError, one_line_errors
from megalm.interop.files import (
    DEFAULT_MAX_SHARD,
    atomic_output_dir,
    check_output_dir,
    converted_parts,
    parse_size,
    plan_shards,
    write_shards,
)
from megalm.model.fused import unfuse_tensors
from megalm.model.hf import ARCHITECTURES, InteropError, run_overrides
from megalm.model.hf_files import HFModelParts
from megalm.training.checkpoint import FORMAT_VERSION

log = logging.getLogger("megalm")


def _source_dtype(hf: dict) -> str:
    return str(hf.get("dtype") or hf.get("torch_dtype") or "float32")


def _tokenizer(hf_dir: Path, out: Path, choice: str | None) -> tuple[Path | None, str | None]:
    """(tokenizer.json to copy into `out`, the tokenizer spec state.json records) for --tokenizer `choice`:
    None = the directory's tokenizer.json if it has one megalm can use, "byte", "none", or a tokenizer.json."""
    if choice is not None and choice.lower() in ("byte", "none"):
        return None, "byte" if choice.lower() == "byte" else None
    file = hf_dir / "tokenizer.json" if choice is None else Path(choice).expanduser().absolute()
    if file.is_dir():
        file = file / "tokenizer.json"
    if choice is None and not file.is_file():
        return None, None
    try:
        HFTokenizer(str(file))
    except MegalmError as e:
        if choice is not None:
            raise InteropError(f"--tokenizer {choice}: {e}") from None
        log.info(f"tokenizer: {file} not kept ({e}); pass --tokenizer to choose one")
        return None, None
    return file, str(out / "tokenizer.json")


def _stored(part: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A part's tensors as every megalm checkpoint stores them: fused projections as their parts, under `model/`."""
    return {f"model/{name}": t for name, t in unfuse_tensors(part, cfg).items()}


def import_hf(hf_dir: str | Path, out: str | Path, *, overwrite: bool = False, tokenizer: str | None = None,
              max_shard_size: str = DEFAULT_MAX_SHARD) -> Path:
    """Write the megalm checkpoint dir of HF model dir `hf_dir` to `out`; returns `out`. `tokenizer`: None (the
    directory's tokenizer.json, if any), "byte", "none" or the path of a tokenizer.json. `max_shard_size`: of each
    weight file, which is held in host memory until written."""
    out = Path(out).expanduser().absolute()
    hf_dir = Path(hf_dir).expanduser().absolute()
    check_output_dir(out, overwrite, hf_dir)
    max_bytes = parse_size(max_shard_size)
    source = HFModelParts(hf_dir)  # read a block at a time while the files are written
    arch, cfg, hf = source.arch, source.cfg, source.hf
    tokenizer_file, spec = _tokenizer(hf_dir, out, tokenizer)
    config = config_to_dict(MegalmConfig(model=cfg, data=DataConfig(tokenizer=spec or "byte")))
    state = {"format_version": FORMAT_VERSION, "step": 0, "consumed_tokens": 0, "optimizer_param_groups": [],
             "world_size": 1, "weights_only": True, "tokenizer": spec,
             "source": {"format": "hf", "path": str(hf_dir), "architecture": ARCHITECTURES[arch],
                        "dtype": _source_dtype(hf), "bos_token_id": hf.get("bos_token_id"),
                        "eos_token_id": hf.get("eos_token_id")}}
    buffers = {f"model/{name}": b for name, b in source.buffers().items()}
    nbytes = {key: t.numel() * t.element_size() for part in source.shapes() for key, t in _stored(part, cfg).items()}
    shards = plan_shards(nbytes | {key: b.nbytes for key, b in buffers.items()}, max_bytes)
    files = [f"shard-00001-model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    with atomic_output_dir(out, overwrite, hf_dir) as tmp:
        write_shards(tmp, files, shards, chain(converted_parts(source, lambda part: _stored(part, cfg)), [buffers]))
        state["files"] = {file: (tmp / file).stat().st_size for file in files}  # as a save lists them (verified)
        (tmp / "state.json").write_text(json.dumps(state, indent=1))
        (tmp / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(config)))
        if tokenizer_file is not None:
            shutil.copyfile(tokenizer_file, tmp / "tokenizer.json")
    kept = "none" if spec is None else "byte" if spec == "byte" else f"tokenizer.json from {tokenizer_file}"
    log.info(f"imported {ARCHITECTURES[arch]} {hf_dir} to {out} (weights only, fp32; tokenizer: {kept})")
    log.info(f"continue pretraining from it: megalm-train {shlex.quote(f'model.init_from={out}')} "
             f"{' '.join(run_overrides(cfg))}")
    if spec not in (None, "byte"):  # the run's data must be tokenized with it (model.init_from checks)
        log.info(f"on a corpus tokenized with its tokenizer: megalm-preprocess --tokenizer {shlex.quote(spec)} "
                 "..., then data=indexed data.path=PREFIX")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="megalm-import", description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("hf_dir", help="a local transformers model dir (config.json + safetensors)")
    parser.add_argument("--out", required=True, help="the checkpoint dir to write (must be absent or empty)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (once complete)")
    parser.add_argument("--tokenizer", default=None,
                        help="byte | none | a tokenizer.json (default: HF_DIR/tokenizer.json if present)")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD,
                        help="largest weight file, e.g. 5GB or 500MB (default %(default)s): host memory holds one "
                             "file and one block of the model while writing")
    parser.add_argument("--debug", action="store_true", help="keep tracebacks")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with one_line_errors(args.debug):
        import_hf(args.hf_dir, args.out, overwrite=args.overwrite, tokenizer=args.tokenizer,
                  max_shard_size=args.max_shard_size)


if __name__ == "__main__":
    main()
