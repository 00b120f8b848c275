"""RoPE in Hugging Face configs: plain rope_theta, or Llama 3.1's frequency scaling (rope_type llama3, megalm's
model.rope_scaling), read from transformers 4's rope_theta and rope_scaling or 5's rope_parameters and written in
both spellings; any other scaling (linear, dynamic, yarn, longrope) is refused. The rest of the mapping is hf.py's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from megalm.config.choices import RopeScaling
from megalm.config.schema import ModelConfig
from megalm.errors import InteropError

# Llama 3.1's rope_scaling keys, megalm's model.rope_scaling fields of the same names
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope_from_hf(hf: Mapping[str, Any], where: str) -> tuple[float, dict[str, Any]]:
    """(rope_theta, model.rope_scaling's values) of a Llama-family config: plain RoPE, or Llama 3.1's scaling
    (rope_type llama3), from transformers 4's rope_theta and rope_scaling or 5's rope_parameters. Any other scaling
    (linear, dynamic, yarn, longrope) is refused: megalm's RoPE does not compute it."""
    legacy, current = hf.get("rope_scaling") or {}, hf.get("rope_parameters") or {}
    kind_of = lambda d: d.get("rope_type", d.get("type", "default"))  # ("type": transformers 4's older spelling)
    scaling_of = lambda d: {**{k: v for k, v in d.items() if k not in ("rope_theta", "type")}, "rope_type": kind_of(d)}
    if legacy and current and scaling_of(legacy) != scaling_of(current):  # transformers 4 reads one, 5 the other
        raise InteropError(f"{where}: rope_parameters={current} and rope_scaling={legacy} disagree; fix config.json")
    which, params = ("rope_scaling", legacy) if legacy else ("rope_parameters", current)
    kind = kind_of(params)
    theta = float(current.get("rope_theta", hf["rope_theta"]))
    if kind == "default":
        if set(params) - {"rope_type", "type", "rope_theta"}:
            raise InteropError(f"{where}: {which}={params} is not plain RoPE; megalm computes rope_type default and "
                               "llama3 only")
        return theta, {}
    if kind != "llama3":
        raise InteropError(f"{where}: {which} of rope_type {kind!r} ({params}); megalm's RoPE computes default and "
                           "llama3 (Llama 3.1's) only")
    missing = [k for k in LLAMA3_KEYS if k not in params]
    if missing:
        raise InteropError(f"{where}: {which} of rope_type llama3 lacks {', '.join(missing)}; fix config.json")
    try:
        factors = {k: float(params[k]) for k in LLAMA3_KEYS[:3]}
    except (TypeError, ValueError):
        raise InteropError(f"{where}: {which}={params}: its factors must be numbers; fix config.json") from None
    return theta, {"type": RopeScaling.llama3, **factors,
                   "original_max_position_embeddings": _whole_number(params, "original_max_position_embeddings", where)}


def hf_rope(cfg: ModelConfig) -> dict[str, Any]:
    """config.json's RoPE keys for `cfg`: transformers 4 reads rope_theta and rope_scaling, 5 rope_parameters."""
    scaling = cfg.rope_scaling
    if scaling.type == "none":
        return {"rope_theta": cfg.rope_theta, "rope_scaling": None,
                "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}}
    llama3 = {"rope_type": "llama3", **{k: getattr(scaling, k) for k in LLAMA3_KEYS}}
    return {"rope_theta": cfg.rope_theta, "rope_scaling": llama3,
            "rope_parameters": {**llama3, "rope_theta": cfg.rope_theta}}


def _whole_number(params: Mapping[str, Any], key: str, where: str) -> int:
    """params[key] as a whole number (8192.0 is 8192), else an InteropError naming it."""
    value = params[key]
    number = (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and
                                                                          math.isfinite(value))
    if not number or value != int(value):
        raise InteropError(f"{where}: {key}={value!r} must be a whole number; fix config.json")
    return int(value)
