"""What `megalm-generate`'s KV cache buys: greedy sampling with and without it, side by side, on one model.

    python tools/bench/kv_cache.py model=125m --prompt-tokens 128 --new-tokens 256

Builds the overrides' model (weights drawn by `init_weights`, fp32, evaluation mode) on --device, and samples
--new-tokens greedily after a prompt of --prompt-tokens ids with `sample(kv_cache=True)` and `sample(kv_cache=False)`
(each token a forward of the whole context, what megalm-generate did before 2026-12-07), --reps times each,
alternating, each call timed by tools/bench/timing.py's `time_calls` (CUDA events, or a host clock). Reports the
median tokens/s of each and their ratio, and whether every call drew the same ids (a sampler that changed the
numbers would show it here too: greedy ids follow the argmax of every step's logits). No stop id: every call draws
--new-tokens, within the model's positions (past them sampling drops its cache: such a run is refused).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from megalm.config.compose import compose_config  # noqa: E402
from megalm.errors import ConfigError  # noqa: E402
from megalm.generate import sample  # noqa: E402
from megalm.model import GPT  # noqa: E402
from megalm.model.gpt import init_weights  # noqa: E402
from tools.bench.cli import check_counts, parse_flags_and_overrides, run_main  # noqa: E402
from tools.bench.timing import time_calls  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3, help="timed calls of each (the median is reported)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", action="store_true", help="print the results as JSON last")
    args, overrides = parse_flags_and_overrides(parser, argv)
    check_counts(args, "prompt_tokens", "new_tokens", "reps")
    cfg = compose_config(overrides)
    positions = cfg.model.max_position_embeddings or cfg.model.seq_length
    if args.prompt_tokens + args.new_tokens > positions:  # past them the cached calls recompute too: a mixed row
        raise ConfigError(f"--prompt-tokens {args.prompt_tokens} and --new-tokens {args.new_tokens} outgrow the "
                          f"model's {positions} positions, where sampling drops its cache; ask for {positions} "
                          "tokens in all or fewer")
    device = torch.device(args.device)
    model = GPT(cfg.model, device=device)
    init_weights(model, cfg.seed)
    model.eval()
    prompt = torch.randint(0, cfg.model.vocab_size, (args.prompt_tokens,),
                           generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    ms: dict[bool, list[float]] = {True: [], False: []}
    drawn: set[tuple[int, ...]] = set()  # every call's ids: one set of them when the cache changes nothing

    def draw(cached: bool) -> None:
        drawn.add(tuple(sample(model, prompt, args.new_tokens, temperature=0, kv_cache=cached)))

    for _ in range(args.reps):
        for cached in (True, False):
            ms[cached] += time_calls(functools.partial(draw, cached), device, warmup=0, iters=1)
    rate = {cached: 1e3 * args.new_tokens / statistics.median(times) for cached, times in ms.items()}
    result = {"device": str(device), "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
              "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
              "tokens_per_s_cached": rate[True], "tokens_per_s_recomputed": rate[False],
              "speedup": rate[True] / rate[False], "same_ids": len(drawn) == 1}
    print("| device | params (M) | prompt | new tokens | KV cache tok/s | recomputed tok/s | speedup | same ids |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    print(f"| {device} | {result['params_m']:.1f} | {args.prompt_tokens} | {args.new_tokens} | {rate[True]:.1f} | "
          f"{rate[False]:.1f} | {result['speedup']:.2f}x | {'yes' if result['same_ids'] else 'NO'} |")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    run_main(main)
