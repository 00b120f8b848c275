"""`megalm-export`: a megalm checkpoint as a Hugging Face model directory (LlamaForCausalLM, GPT2LMHeadModel,
Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM or MixtralForCausalLM: megalm/model/hf.py ARCHITECTURES).

    megalm-export outputs/2026-11-21/10-00-00 --format hf --out /tmp/hf-model

Why: so a model trained here can be evaluated, served and shared with the `transformers` ecosystem. The checkpoint
may come from any layout (TP/PP/ZeRO-1): one CPU process reads it a block at a time, writing each weight file
as soon as its tensors are read, so that host memory holds a block and a file, not the model. The directory holds
safetensors weights (sharded past --max-shard-size, with model.safetensors.index.json), config.json,
generation_config.json and, when the run used a Hugging Face tokenizer, tokenizer.json + tokenizer_config.json.
The mapping is megalm.model.hf's; the directory is written whole or not at all.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path
from typing import Any

from megalm.data.blend import tokenizer_identity
from megalm.data.tokenizer import HFTokenizer, build_tokenizer, trained_with
from megalm.errors import MegalmError, one_line_errors
from megalm.interop.files import (
    DEFAULT_MAX_SHARD,
    atomic_output_dir,
    check_output_dir,
    converted_parts,
    hf_file_names,
    parse_size,
    plan_shards,
    write_hf_index,
    write_shards,
)
from megalm.model.hf import ARCHITECTURES, DTYPES, InteropError, architecture_of, hf_config
from megalm.model.hf_tensors import megalm_to_hf
from megalm.training.checkpoint import SavedModelParts

log = logging.getLogger("megalm")


def _tokenizer_spec(state: dict[str, Any], config: dict[str, Any], override: str | None) -> str | None:
    """The run's tokenizer: --tokenizer, else the one its data was made with (state.json), else config's
    data.tokenizer; None for synthetic data (no tokenizer) or --tokenizer none."""
    if override is not None:
        return None if override.lower() == "none" else override
    if "tokenizer" in state:
        return state["tokenizer"]
    return config.get("data", {}).get("tokenizer")


def export_hf(source: str | Path, out: str | Path, *, overwrite: bool = False, dtype: str = "auto",
              max_shard_size: str = DEFAULT_MAX_SHARD, tokenizer: str | None = None) -> Path:
    """Write the HF model directory of checkpoint (or run dir) `source` to `out`; returns `out`.

    `dtype` "auto": an imported model's original dtype (so export(import(x)) writes x's tensors), else float32.
    """
    out = Path(out).expanduser().absolute()
    check_output_dir(out, overwrite, source)  # before any work: refuse fast
    if dtype not in ("auto", *DTYPES):
        raise InteropError(f"--dtype={dtype} is not one of auto|{'|'.join(DTYPES)}")
    max_bytes = parse_size(max_shard_size)
    weights = SavedModelParts(source)  # read a block at a time while the files are written
    meta, cfg = weights.meta, weights.cfg
    bias = {name: b for name, b in weights.buffers().items() if name.endswith("expert_bias")}  # buffers: only these
    if biased := [name for name, b in bias.items() if bool(b.any())]:  # the model adds it to the routers' scores
        raise InteropError(f"{source}: {biased[0]} (+{len(biased) - 1} more) holds a learned selection bias that "
                           "Hugging Face's MoE routers do not have: the exported model would route otherwise; "
                           "export a model trained without one (model.moe.bias_update_rate=0 from the start)")
    origin = meta.state.get("source") or {}  # an imported model (megalm-import) keeps its dtype and token ids
    if dtype == "auto":
        dtype = origin.get("dtype") if origin.get("dtype") in DTYPES else "float32"
    arch = architecture_of(cfg)
    if cfg.moe.num_experts and cfg.moe.capacity_factor is not None:  # megalm drops in evaluation and generation too
        log.warning(f"{source}: model.moe.capacity_factor={cfg.moe.capacity_factor}: {ARCHITECTURES[arch]} routes "
                    "without a capacity (dropless), so its logits differ from megalm's wherever an expert's queue "
                    "was full; megalm-generate and evaluation drop as training did")

    spec = _tokenizer_spec(meta.state, meta.config, tokenizer)
    tok = None
    if spec is not None:
        try:
            tok = build_tokenizer(spec)
        except MegalmError as e:
            if tokenizer is not None:  # the user's own --tokenizer
                raise InteropError(f"--tokenizer {tokenizer}: {e}") from None
            raise InteropError(f"the run's tokenizer cannot be loaded ({e}); pass --tokenizer PATH/tokenizer.json "
                               "or --tokenizer none") from None
    trained = meta.state.get("tokenizer_vocab_size")
    if tok is not None and not trained_with(tok, cfg.vocab_size, trained):  # as megalm-generate refuses it
        raise InteropError(f"tokenizer {spec} has {tok.vocab_size} tokens, the run's had "
                           f"{trained or f'at most {cfg.vocab_size}'}: it is not the one {meta.path} was trained "
                           "with; pass that one with --tokenizer PATH, or --tokenizer none")
    eod = tok.eod_id if tok is not None else None
    # an imported model's own bos and eos ids, while it ships its own tokenizer; another tokenizer's are its eod
    own = tokenizer is None or tokenizer_identity(spec) == tokenizer_identity(meta.state.get("tokenizer") or "")
    bos, eos = ((origin.get("bos_token_id"), origin.get("eos_token_id")) if origin.get("format") == "hf" and own
                else (eod, eod))

    # the files' plan from the shapes alone: transformers' names, each tensor in its dtype
    torch_dtype = DTYPES[dtype]
    nbytes = {name: t.numel() * torch_dtype.itemsize for part in weights.shapes()
              for name, t in megalm_to_hf(part, cfg, arch).items()}
    shards = plan_shards(nbytes, max_bytes)
    files = hf_file_names(len(shards))
    # checked against the checkpoint read too, where `source` was a run dir or a dir of runs, before anything is written
    with atomic_output_dir(out, overwrite, meta.path) as tmp:
        write_shards(tmp, files, shards, converted_parts(weights, lambda part: {
            name: t.to(torch_dtype) for name, t in megalm_to_hf(part, cfg, arch).items()}))
        write_hf_index(tmp, files, shards, sum(nbytes.values()))
        config = hf_config(cfg, arch, dtype, bos, eos)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config[k] is not None}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        if isinstance(tok, HFTokenizer):
            shutil.copyfile(tok.spec, tmp / "tokenizer.json")
            # the tokens of the ids config.json and generation_config.json name (an import's <s> and </s>)
            token = {key: tok.token_of(i) if isinstance(i, int) and tok.token_of(i) else tok.eod_token
                     for key, i in (("bos_token", bos), ("eos_token", eos))}
            tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", **token,
                          "model_max_length": cfg.max_position_embeddings,
                          "clean_up_tokenization_spaces": False}
            (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    if isinstance(tok, HFTokenizer):
        log.info(f"tokenizer: copied {tok.spec} (+ tokenizer_config.json; AutoTokenizer loads it)")
    elif tok is not None:
        log.info(f"tokenizer: none written (the byte tokenizer has no transformers class: ids 0-255 are UTF-8 "
                 f"bytes, {eod} is end of document)")
    else:
        log.info("tokenizer: none written (the checkpoint has none: synthetic data, an import without one, "
                 "or --tokenizer none)")
    log.info(f"exported {meta.path} (step {meta.state.get('step')}) as {ARCHITECTURES[arch]} to {out} "
             f"({len(files)} weight file(s), {dtype})")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="megalm-export", description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("checkpoint", help="a checkpoint dir (RUN/checkpoints/step_...) or a run dir (uses latest)")
    parser.add_argument("--format", choices=["hf"], default="hf", help="output format (hf: transformers)")
    parser.add_argument("--out", required=True, help="output directory (must be absent or empty)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (once complete)")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                        help="dtype of the written weights (auto: an imported model's own, else float32)")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD, help="largest safetensors file (e.g. 5GB)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer.json to ship instead of the run's (or 'none'); default: the run's")
    parser.add_argument("--debug", action="store_true", help="keep tracebacks")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with one_line_errors(args.debug):
        export_hf(args.checkpoint, args.out, overwrite=args.overwrite, dtype=args.dtype,
                  max_shard_size=args.max_shard_size, tokenizer=args.tokenizer)


if __name__ == "__main__":
    main()
