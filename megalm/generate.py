"""`megalm-generate`: sample text from a checkpoint, to see what a model learned.

    megalm-generate outputs/2026-11-21/10-00-00 --prompt "def " --max-new-tokens 200 --temperature 0.8 --top-k 50

The checkpoint is self-describing (its config.yaml rebuilds the model, state.json names the
tokenizer). Sampling keeps each layer's keys and values (megalm/model/kv_cache.py): one forward of the
prompt, then one of each new token, within the model's positions (`sample` says when it cannot).
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from megalm.errors import MegalmError, one_line_errors

if TYPE_CHECKING:
    from megalm.model import GPT

log = logging.getLogger("megalm")


@torch.no_grad()
def sample(model: GPT, prompt: list[int], max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
           eod_id: int | Collection[int] | None = None, generator: torch.Generator | None = None,
           vocab_size: int | None = None, kv_cache: bool = True) -> list[int]:
    """Autoregressive sampling; the context is cropped to the model's positions; stops at eod (`eod_id`: one id or
    several, e.g. an imported chat model's end-of-turn beside it). `vocab_size`: the tokenizer's, when the model's is
    larger (ids past it decode to nothing); default the model's.

    `kv_cache`: each forward feeds only the tokens after those cached (`KVCache`), the same logits as a forward of
    the whole context up to rounding. Without it, once the context outgrows the model's positions (the newest ones
    kept: every position shifts), for an MoE model that drops tokens by how many a forward routes
    (model.moe.capacity_factor), or for a model in training mode with attention dropout, each token is a forward of
    the whole context (said once a process). The model samples in the mode it is in: `model.eval()` first for no
    dropout (`load_for_generation` does)."""
    from megalm.model.gpt import real_logits
    from megalm.model.kv_cache import KVCache

    if not prompt:
        raise ValueError("sampling needs a prompt of one token or more")
    stops = {eod_id} if isinstance(eod_id, int) else set(eod_id or ())
    device = next(model.parameters()).device
    max_positions = model.cfg.max_position_embeddings
    moe = model.cfg.moe
    if kv_cache and moe.num_experts and moe.capacity_factor is not None:
        _warn_once("model.moe.capacity_factor: an expert's capacity follows the tokens a forward routes, so each token "
                   "is a forward of the whole context (no KV cache)")
        kv_cache = False
    if kv_cache and model.training and model.cfg.attention_dropout:
        _warn_once("the model is in training mode with model.attention_dropout: each token is a forward of the whole "
                   "context, its dropout drawn again (no KV cache; model.eval() samples without dropout, with it)")
        kv_cache = False
    # slots for what this sample can feed, not the model's every position (an import's 32K or 128K: GiBs on a GPU)
    cache = KVCache(len(model.layers), min(max_positions, len(prompt) + max_new_tokens)) if kv_cache else None
    ids = list(prompt)
    for _ in range(max_new_tokens):
        if cache is not None and len(ids) > max_positions:
            _warn_once(f"the context outgrew model.max_position_embeddings={max_positions}: each further token is a "
                       f"forward of the newest {max_positions} (their positions shift; no KV cache)")
            cache = None
        first = cache.length if cache is not None else max(len(ids) - max_positions, 0)
        fed = torch.tensor(ids[first:], dtype=torch.long, device=device)
        n = fed.numel()
        positions = torch.arange(n, device=device) + (first if cache is not None else 0)
        cu = torch.tensor([0, n], dtype=torch.int32, device=device)
        # Only the real vocab: the padding columns (megalm.model.gpt, VOCAB_PARAMS) are never sampled.
        logits = real_logits(model(fed, positions, cu, n, context=cache)[-1],
                             vocab_size or model.cfg.vocab_size).float()
        if temperature <= 0:
            next_id = int(logits.argmax())
        else:
            logits = (logits - logits.max()) / temperature  # at most 0: a tiny temperature gives -inf, never NaN
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            next_id = int(torch.multinomial(probs.cpu(), 1, generator=generator))
        ids.append(next_id)
        if next_id in stops:
            break
    return ids[len(prompt):]


@functools.cache
def _warn_once(message: str) -> None:
    """A warning line once a process: --num-samples N samples N times, each meeting the same condition."""
    log.warning(message)


class ForGeneration(NamedTuple):
    """What sampling from a checkpoint needs: the model, its tokenizer, the ids it stops at and the ids every prompt
    starts with (a bos, where the tokenizer puts one before a text)."""
    model: GPT
    tokenizer: object
    stops: set[int]
    start: list[int]
    checkpoint: Path  # the checkpoint dir read (a run dir's latest, a dir of runs' newest)


def load_for_generation(path: str, device: str = "cpu", tokenizer: str | None = None) -> ForGeneration:
    """Model (weights loaded), tokenizer, stops and start of a checkpoint dir or run dir; `tokenizer` (a
    tokenizer.json or "byte") in place of the one the checkpoint names. A tokenizer of another vocabulary than the
    model's is refused: it would decode the ids into other text. The stops are the tokenizer's eod and, for a model
    imported with its own tokenizer, its config's eos ids (a chat model's end of turn: Llama-3-Instruct's
    <|eot_id|>, Qwen's <|im_end|>), which the eod alone missed, sampling to --max-new-tokens. A prompt starts as the
    tokenizer starts a text (Llama's <s> or <|begin_of_text|>), as transformers' generate starts it and as
    megalm-preprocess starts a document since 2026-12-06 (`encode` leaves it out)."""
    # the model and checkpoint stack (2-3 s of imports) only now: a bad flag is answered before it
    from megalm.data.tokenizer import build_tokenizer, trained_with
    from megalm.training.checkpoint import load_saved_model

    meta, model = load_saved_model(path, device)
    model.eval()
    sample_with_any_attention_backend(model)
    spec = tokenizer or meta.state.get("tokenizer")
    if spec is None:
        raise MegalmError(f"checkpoint {meta.path} was trained without a tokenizer (synthetic data); nothing to decode "
                          "(--tokenizer PATH decodes with one)")
    try:
        built = build_tokenizer(spec)
    except MegalmError as e:
        raise MegalmError(f"{e}; or pass megalm-generate --tokenizer PATH" if tokenizer is None else str(e)) from None
    trained = meta.state.get("tokenizer_vocab_size")  # (checkpoints since 2026-11-30; else only the model's bound)
    if not trained_with(built, model.cfg.vocab_size, trained):
        raise MegalmError(f"tokenizer {spec} has {built.vocab_size} tokens, the run's had "
                          f"{trained or f'at most {model.cfg.vocab_size}'}: it is not the one {meta.path} was trained "
                          "with; pass that one with --tokenizer PATH")
    stops = {built.eod_id}
    source = meta.state.get("source") or {}
    if tokenizer is None and source.get("format") == "hf":  # its own tokenizer: its own ids
        eos = source.get("eos_token_id")
        stops.update(i for i in (eos if isinstance(eos, list) else [eos]) if isinstance(i, int))
    return ForGeneration(model, built, stops, built.prompt_start(), meta.path)


def sample_with_any_attention_backend(model: GPT) -> None:
    """Attention picks its backend here (auto): the run's `model.attention_backend` (cudnn, flash_attn, torch_varlen:
    bf16 on a GPU) refused the fp32 model megalm-generate samples with, and the fix it named is no flag of this
    command. The backend changes no numbers a sample shows."""
    from megalm.config.choices import AttentionBackend
    from megalm.model.attention import Attention

    layers = [m for m in model.modules() if isinstance(m, Attention)]
    named = {str(m.backend) for m in layers} - {AttentionBackend.auto.value}
    if named:
        log.info(f"model.attention_backend={named.pop()} was the training run's; sampling picks its own (auto)")
        for m in layers:
            m.backend = AttentionBackend.auto


# [eod] was the context of an empty prompt: no trained position reads eod as its input (the loss of the token after a
# document's end, the next document's first, is masked), so the first token was sampled from noise (an audit)
NO_START = ("a model never learns a document's first token (its loss starts at the second) and this tokenizer puts "
            "no bos before a text, so an empty prompt has no trained context")


def _check_sampling_args(args: argparse.Namespace) -> None:
    """One line for each flag out of its range, before anything loads."""
    for flag, value, low, what in (("--max-new-tokens", args.max_new_tokens, 1, ""),
                                   ("--num-samples", args.num_samples, 1, ""),
                                   ("--top-k", args.top_k, 0, " (0: no top-k filtering)"),
                                   ("--temperature", args.temperature, 0, " (0: greedy)")):
        if not value >= low or value == float("inf"):
            raise MegalmError(f"{flag} {value} must be {'a finite number ' * isinstance(value, float)}>= {low}{what}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise MegalmError(f"--device {args.device} is not a device; use cpu or cuda (cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise MegalmError(f"--device {args.device}, but no CUDA device is visible; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise MegalmError(f"--device {args.device}: megalm-generate runs on cpu or cuda")


def continuation(tokenizer, prompt: list[int], generated: list[int]) -> str:
    """The text `generated` adds after `prompt`: decoded together with the prompt, less the prompt's own decoding.
    Decoded alone, a sentencepiece-style (Metaspace) or WordPiece decoder drops the space that starts it:
    "the cat" + "the ..." printed "the catthe ..." (an audit, 2026-12-04)."""
    ids = [t for t in generated if t != tokenizer.eod_id]
    head, whole = tokenizer.decode(prompt), tokenizer.decode(prompt + ids)
    return whole[len(head):] if whole.startswith(head) else tokenizer.decode(ids)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="megalm-generate", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint dir (RUN/checkpoints/step_...), a run dir (its latest), or "
                        "a dir of runs such as outputs/ (the newest run's latest: named on stderr)")
    parser.add_argument("--prompt", default="", help="text to continue (empty only for a tokenizer that puts a bos "
                        "before a text: a document's first token is never trained)")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="default 200; the context is cropped to the "
                        "model's model.max_position_embeddings, its newest tokens kept")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy; default 0.8")
    parser.add_argument("--top-k", type=int, default=50, help="0 = no top-k filtering; default 50")
    parser.add_argument("--num-samples", type=int, default=1, help="default 1")
    parser.add_argument("--seed", type=int, default=0, help="default 0")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="default cuda where one is visible, else cpu")
    parser.add_argument("--tokenizer", default=None,
                        help="a tokenizer.json (or 'byte') to decode with; default: the one the checkpoint names")
    parser.add_argument("--debug", action="store_true", help="keep tracebacks")
    args = parser.parse_args(argv)
    with one_line_errors(args.debug):
        _check_sampling_args(args)
        model, tokenizer, stops, start, checkpoint = load_for_generation(args.checkpoint, args.device, args.tokenizer)
        text = tokenizer.encode(args.prompt)
        if not start + text:  # a bos alone is a trained context, as transformers' generate samples from it
            raise MegalmError(f"megalm-generate needs --prompt TEXT to continue: {NO_START}" if not args.prompt else
                              f"--prompt {args.prompt!r} encodes to no tokens; {NO_START}")
        prompt = start + text
        if Path(args.checkpoint).expanduser().absolute() != checkpoint.absolute():  # a run dir's latest, a dir of
            sys.stderr.write(f"megalm-generate: sampling from {checkpoint}\n")  # runs' newest: which one it read
        generator = torch.Generator().manual_seed(args.seed)
        for i in range(args.num_samples):
            out = sample(model, prompt, args.max_new_tokens, args.temperature, args.top_k or None,
                         stops, generator, tokenizer.vocab_size)
            out = out[:-1] if out and out[-1] in stops else out
            if args.num_samples > 1:
                print(f"--- sample {i + 1}")
            print(args.prompt + continuation(tokenizer, prompt, out), flush=True)


if __name__ == "__main__":
    main()
