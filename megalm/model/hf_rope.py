"""RoPE in Hugging Face configs: plain rope_theta, Llama 3.1's frequency scaling (rope_type llama3) or YaRN (megalm's
model.rope_scaling), read from transformers 4's rope_theta and rope_scaling or 5's rope_parameters and written in
both spellings; any other scaling (linear, dynamic, longrope) is refused. The rest of the mapping is hf.py's (configs)
and hf_tensors.py's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from megalm.config.choices import RopeScaling
from megalm.config.schema import ModelConfig
from megalm.errors import InteropError
from megalm.model.rope import yarn_mscale

# Llama 3.1's rope_scaling keys, megalm's model.rope_scaling fields of the same names
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# YaRN's, as transformers reads them (mscale and mscale_all_dim become attention_factor on import)
YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "truncate")
_YARN_ACCEPTED = {*YARN_KEYS, "mscale", "mscale_all_dim", "rope_type", "type", "rope_theta"}
log = logging.getLogger("megalm")


def rope_from_hf(hf: Mapping[str, Any], where: str) -> tuple[float, dict[str, Any]]:
    """(rope_theta, model.rope_scaling's values) of a Llama-family config: plain RoPE, Llama 3.1's scaling (rope_type
    llama3) or YaRN, from transformers 4's rope_theta and rope_scaling or 5's rope_parameters. Any other scaling
    (linear, dynamic, longrope) is refused: megalm's RoPE does not compute it."""
    legacy, current = hf.get("rope_scaling") or {}, hf.get("rope_parameters") or {}
    kind_of = lambda d: d.get("rope_type", d.get("type", "default"))  # ("type": transformers 4's older spelling)
    scaling_of = lambda d: {**{k: v for k, v in d.items() if k not in ("rope_theta", "type")}, "rope_type": kind_of(d)}
    if legacy and current and scaling_of(legacy) != scaling_of(current):  # transformers 4 reads one, 5 the other
        raise InteropError(f"{where}: rope_parameters={current} and rope_scaling={legacy} disagree; fix config.json")
    which, params = ("rope_scaling", legacy) if legacy else ("rope_parameters", current)
    kind = kind_of(params)
    # transformers 5 reads a legacy rope_scaling with its own rope_theta, else the top-level one (as 4 does), over
    # rope_parameters'
    theta = float(legacy.get("rope_theta", hf["rope_theta"]) if legacy else current.get("rope_theta", hf["rope_theta"]))
    if kind == "default":
        if set(params) - {"rope_type", "type", "rope_theta"}:
            raise InteropError(f"{where}: {which}={params} is not plain RoPE; megalm computes rope_type default, "
                               "llama3 and yarn only")
        return theta, {}
    if kind not in ("llama3", "yarn"):
        raise InteropError(f"{where}: {which} of rope_type {kind!r} ({params}); megalm's RoPE computes default, "
                           "llama3 (Llama 3.1's) and yarn only")
    params = dict(params)
    if kind == "yarn":
        if unknown := sorted(set(params) - _YARN_ACCEPTED):
            raise InteropError(f"{where}: {which} of rope_type yarn sets {', '.join(unknown)}, which megalm's YaRN "
                               "does not compute")
        if params.get("factor") is None and params.get("original_max_position_embeddings"):  # (DeepSeek-V3's form)
            params["factor"] = hf["max_position_embeddings"] / params["original_max_position_embeddings"]
    if params.get("original_max_position_embeddings") is None and "max_position_embeddings" in hf:
        # transformers 5 takes the model's context (4 raised KeyError for llama3); a top-level key its AutoConfig
        # leaves out and its model classes read: one that disagrees is refused, as ambiguous
        outer = hf.get("original_max_position_embeddings")
        if outer is not None and outer != hf["max_position_embeddings"]:
            raise InteropError(f"{where}: original_max_position_embeddings={outer} stands outside {which}, which has "
                               f"none: transformers 5 reads it or max_position_embeddings="
                               f"{hf['max_position_embeddings']} by how it loads; move it into {which} in config.json")
        params["original_max_position_embeddings"] = hf["max_position_embeddings"]
        log.info(f"{where}: {which} of rope_type {kind} has no original_max_position_embeddings: "
                 f"max_position_embeddings={hf['max_position_embeddings']} is read, as transformers 5 reads it")
    required = LLAMA3_KEYS if kind == "llama3" else YARN_KEYS[:2]
    missing = [k for k in required if params.get(k) is None]
    if missing:
        raise InteropError(f"{where}: {which} of rope_type {kind} lacks {', '.join(missing)}; fix config.json")
    numbers = [k for k in (LLAMA3_KEYS[:3] if kind == "llama3" else ("factor", "beta_fast", "beta_slow",
                                                                    "attention_factor", "mscale", "mscale_all_dim"))
               if params.get(k) is not None]
    try:
        values = {k: float(params[k]) for k in numbers}
    except (TypeError, ValueError):
        raise InteropError(f"{where}: {which}={params}: its factors must be numbers; fix config.json") from None
    values["original_max_position_embeddings"] = whole_number(params, "original_max_position_embeddings", where)
    outer = hf.get("original_max_position_embeddings")  # (transformers 5 reads a top-level one over the scaling's)
    if outer is not None and outer != values["original_max_position_embeddings"]:
        raise InteropError(f"{where}: original_max_position_embeddings={outer} and {which}'s "
                           f"{values['original_max_position_embeddings']} disagree; fix config.json")
    if kind == "llama3":
        return theta, {"type": RopeScaling.llama3, **values}
    mscale, mscale_all_dim = values.pop("mscale", None), values.pop("mscale_all_dim", None)
    if values.get("attention_factor") is None and mscale and mscale_all_dim:  # transformers' rule for the pair
        values["attention_factor"] = yarn_mscale(values["factor"], mscale) / yarn_mscale(values["factor"],
                                                                                          mscale_all_dim)
    # transformers reads truncate with get("truncate", True): an explicit null does not truncate
    return theta, {"type": RopeScaling.yarn, **values, "truncate": bool(params.get("truncate", True))}


def hf_rope(cfg: ModelConfig) -> dict[str, Any]:
    """config.json's RoPE keys for `cfg`: transformers 4 reads rope_theta and rope_scaling, 5 rope_parameters."""
    scaling = cfg.rope_scaling
    if scaling.type == "none":
        return {"rope_theta": cfg.rope_theta, "rope_scaling": None,
                "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}}
    keys = LLAMA3_KEYS if scaling.type == "llama3" else YARN_KEYS
    # truncate only when off: a transformers from before the key reads its absence as the default, true
    written = {"rope_type": str(scaling.type), **{k: getattr(scaling, k) for k in keys
                                                  if getattr(scaling, k) is not None
                                                  and not (k == "truncate" and getattr(scaling, k))}}
    return {"rope_theta": cfg.rope_theta, "rope_scaling": written,
            "rope_parameters": {**written, "rope_theta": cfg.rope_theta}}


def whole_number(hf: Mapping[str, Any], key: str, where: str) -> int:
    """config.json's `key` (or a rope section's) as a whole number (2.0 is 2); 2.5 or a string is an InteropError
    naming it: int() had dropped the fraction, and the tensors of the layers it dropped were reported missing later.
    (Here, not in hf.py, which reads this module's RoPE keys: both read whole numbers so.)"""
    value = hf[key]
    # (json reads Infinity and NaN, on which int() raises its own error)
    infinite = isinstance(value, float) and not math.isfinite(value)  # (an int never is; isfinite overflows on 10**400)
    if isinstance(value, bool) or not isinstance(value, int | float) or infinite or value != int(value):
        raise InteropError(f"{where}: {key}={value!r} must be a whole number; fix config.json")
    return int(value)
