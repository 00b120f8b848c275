"""The mapping between megalm's GPT and Hugging Face's LlamaForCausalLM / GPT2LMHeadModel and their kin: configs
(the tensors' names and layouts are hf_tensors.py's; beyond Llama: Qwen3, Qwen3-MoE and Mixtral in hf_moe.py, RoPE
scaling in hf_rope.py; reading a directory in hf_files.py). Each of megalm's two model styles is exactly one
`transformers` architecture (hf_tensors.py has the table), following transformers' own modeling and config files,
which define what a key means; a key a config.json omits takes its architecture's default (`HF_DEFAULTS`).

Reading: hf_files.py's `read_hf_weights` (hf_tensors.py's `HFWeights`, one tensor at a time) is what
`model.init_from=hf:DIR` (megalm/training/init_from.py) reads, its `HFModelParts` (a block at a time) what
megalm-import (megalm/interop/hf_import.py) writes; nothing here imports `transformers`. Writing a directory (atomic
output, shards) is the CLI's part, in megalm/interop/files.py.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import torch

from megalm.config import ModelConfig, override_value, resolve_model_defaults, validate_model
from megalm.config.schema import RopeScalingConfig
from megalm.errors import ConfigError, InteropError
from megalm.model.hf_moe import (
    MIXTRAL,
    MOE_DEFAULTS,
    QWEN3,
    QWEN3_MOE,
    MoEMappingError,
    moe_architecture,
    moe_config_from_hf,
    moe_hf_config,
)
from megalm.model.hf_rope import LLAMA3_KEYS, YARN_KEYS, hf_rope, rope_from_hf, whole_number

log = logging.getLogger("megalm")

LLAMA, GPT2, MISTRAL, QWEN2 = "llama", "gpt2", "mistral", "qwen2"
ARCHITECTURES = {LLAMA: "LlamaForCausalLM", GPT2: "GPT2LMHeadModel", QWEN2: "Qwen2ForCausalLM",
                 QWEN3: "Qwen3ForCausalLM", QWEN3_MOE: "Qwen3MoeForCausalLM", MIXTRAL: "MixtralForCausalLM",
                 MISTRAL: "MistralForCausalLM"}
# Llama's names, plus q/k/v biases (Qwen2), QK-norm and/or MoE blocks (hf_moe.py); Mistral is Llama's model (its
# sliding window refused), imported only: megalm exports that model as LlamaForCausalLM
LLAMA_FAMILY = (LLAMA, QWEN2, QWEN3, QWEN3_MOE, MIXTRAL, MISTRAL)
DENSE_LLAMAS = (LLAMA, MISTRAL, QWEN2)
# the sliding window's switch, where a window size alone does not turn it on
WINDOW_SWITCHED = (QWEN2, QWEN3, QWEN3_MOE)
WINDOWED = (MISTRAL, MIXTRAL)  # a sliding_window in every layer (model.sliding_window); Qwen's are per layer
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# transformers' defaults (their XConfig.__init__ signatures) for the keys a config.json may omit, per model_type:
# a hand-written Mixtral config without rms_norm_eps or rope_theta means 1e-5 and 1e6 there, not Llama's values.
# None: derived (head_dim = hidden_size / heads, num_key_value_heads = heads, n_inner = 4 * n_embd).
_LLAMA_DEFAULTS = {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                   "tie_word_embeddings": False, "attention_dropout": 0.0, "initializer_range": 0.02,
                   "hidden_act": "silu", "head_dim": None, "num_key_value_heads": None}
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    LLAMA: _LLAMA_DEFAULTS,
    QWEN2: {**_LLAMA_DEFAULTS, "max_position_embeddings": 32768, "num_key_value_heads": 32, "max_window_layers": 28},
    QWEN3: {**_LLAMA_DEFAULTS, "max_position_embeddings": 32768, "head_dim": 128, "num_key_value_heads": 32,
            "max_window_layers": 28},
    QWEN3_MOE: {**_LLAMA_DEFAULTS, "max_position_embeddings": 32768, "num_key_value_heads": 4,
                **MOE_DEFAULTS[QWEN3_MOE]},
    MIXTRAL: {**_LLAMA_DEFAULTS, "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
              "num_key_value_heads": 8, **MOE_DEFAULTS[MIXTRAL]},
    # a Mistral config without sliding_window has transformers' 4,096-token window: refused, as a set one is
    MISTRAL: {**_LLAMA_DEFAULTS, "max_position_embeddings": 4096 * 32, "num_key_value_heads": 8,
              "sliding_window": 4096},
    GPT2: {"n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
           "layer_norm_epsilon": 1e-5, "resid_pdrop": 0.1, "attn_pdrop": 0.1, "initializer_range": 0.02,
           "activation_function": "gelu_new", "tie_word_embeddings": True},
}
# GPT-2 activations that are the tanh approximation of GELU, i.e. megalm's GeluMLP.
GPT2_TANH_GELUS = ("gelu_pytorch_tanh", "gelu_new")

# ---------------------------------------------------------------------------- architectures


def architecture_of(cfg: ModelConfig) -> str:
    """The HF architecture that computes exactly what `cfg`'s GPT computes (llama, qwen3, qwen3_moe, mixtral or
    gpt2); else InteropError."""
    style = (cfg.norm, cfg.activation, cfg.position_embedding)
    if style == ("rmsnorm", "swiglu", "rope"):
        if cfg.bias:
            raise InteropError("model.bias=true with rmsnorm/swiglu/rope has no Hugging Face counterpart "
                               "(LlamaForCausalLM's norms have no bias); export supports bias=false only")
        if cfg.qkv_bias and (cfg.moe.num_experts or cfg.qk_norm):
            raise InteropError("model.qkv_bias=true maps to Qwen2ForCausalLM, which has neither MoE blocks nor "
                               "QK-norm; export a model without them")
        if cfg.moe.num_experts:
            try:
                arch = moe_architecture(cfg)
            except MoEMappingError as e:
                raise InteropError(str(e)) from None
        else:
            arch = QWEN2 if cfg.qkv_bias else QWEN3 if cfg.qk_norm else MISTRAL if cfg.sliding_window else LLAMA
        return arch  # (a window: Mistral's, Mixtral's, or Qwen's use_sliding_window in every layer)
    if cfg.moe.num_experts or cfg.qk_norm or cfg.sliding_window is not None:
        raise InteropError("MoE blocks, QK-norm and a sliding window map to Hugging Face with rmsnorm/swiglu/rope "
                           "only (Qwen3, Qwen3-MoE, Mixtral, Mistral); export a Llama-style model")
    if style == ("layernorm", "gelu", "learned"):
        problems = []
        if not cfg.bias:
            problems.append("bias=false (GPT2LMHeadModel has biases everywhere)")
        if not cfg.tie_embeddings:
            problems.append("tie_embeddings=false (GPT2LMHeadModel ties its head to wte)")
        if cfg.num_kv_heads != cfg.num_heads:
            problems.append(f"num_kv_heads={cfg.num_kv_heads} != num_heads={cfg.num_heads} (GPT-2 has no GQA)")
        if cfg.head_dim is not None and cfg.head_dim * cfg.num_heads != cfg.hidden_size:
            problems.append(f"head_dim={cfg.head_dim} != hidden_size/num_heads (GPT2LMHeadModel has no head_dim)")
        if problems:
            raise InteropError(f"the GPT-2-style model cannot be exported as GPT2LMHeadModel: {'; '.join(problems)}")
        return GPT2
    raise InteropError(f"model norm={cfg.norm}, activation={cfg.activation}, position_embedding="
                       f"{cfg.position_embedding} maps to no Hugging Face architecture: LlamaForCausalLM needs "
                       "rmsnorm/swiglu/rope, GPT2LMHeadModel needs layernorm/gelu/learned")


def hf_config(cfg: ModelConfig, arch: str, dtype: str, bos_id: int | list[int] | None,
              eos_id: int | list[int] | None) -> dict[str, Any]:
    """config.json for `cfg` (the keys transformers' LlamaConfig / GPT2Config read; dropout off as in megalm's
    `dropout` values). Token ids outside the vocabulary are left out (transformers warns about them)."""
    def in_vocab(ids: int | list[int] | None) -> int | list[int] | None:
        valid = lambda i: isinstance(i, int) and 0 <= i < cfg.vocab_size
        return ids if valid(ids) or (isinstance(ids, list) and ids and all(map(valid, ids))) else None

    common = {"architectures": [ARCHITECTURES[arch]], "model_type": arch, "vocab_size": cfg.vocab_size,
              "bos_token_id": in_vocab(bos_id), "eos_token_id": in_vocab(eos_id),
              "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std, "use_cache": True,
              "dtype": dtype, "torch_dtype": dtype}
    if arch in LLAMA_FAMILY:
        extra = ({} if arch == LLAMA else {"sliding_window": cfg.sliding_window} if arch == MISTRAL else
                 moe_hf_config(cfg, arch) if arch != QWEN2 else
                 {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.num_layers})
        if arch == MIXTRAL:
            extra["sliding_window"] = cfg.sliding_window
        elif arch in WINDOW_SWITCHED and cfg.sliding_window is not None:  # every layer's, as megalm's
            extra.update(use_sliding_window=True, sliding_window=cfg.sliding_window, max_window_layers=0)
        return {**common, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
                "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
                "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                "hidden_act": "silu", "max_position_embeddings": cfg.max_position_embeddings,
                "rms_norm_eps": cfg.norm_eps, **hf_rope(cfg),
                # (Llama's attention_bias would be o_proj's too: Qwen2's config has no such key, its q/k/v biases
                # are its architecture's)
                **({} if arch == QWEN2 else {"attention_bias": False}), "mlp_bias": False,
                "attention_dropout": cfg.attention_dropout, "pretraining_tp": 1, **extra}
    return {**common, "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers, "n_head": cfg.num_heads,
            "n_inner": cfg.ffn_hidden_size, "n_positions": cfg.max_position_embeddings, "n_ctx":
            cfg.max_position_embeddings, "activation_function": "gelu_pytorch_tanh",
            "layer_norm_epsilon": cfg.norm_eps, "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout,
            "attn_pdrop": cfg.attention_dropout, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}


def model_config_from_hf(hf: Mapping[str, Any], where: str) -> tuple[str, ModelConfig]:
    """(architecture, megalm ModelConfig) for a transformers config.json, or InteropError naming what megalm
    cannot compute. A key the file omits takes its architecture's transformers default (HF_DEFAULTS)."""
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise InteropError(f"{where}: model_type={model_type!r} is not supported; megalm imports "
                           f"{', '.join(ARCHITECTURES)}")
    given, hf = hf, {**HF_DEFAULTS[model_type], **hf}
    window = _sliding_window(hf, given, model_type, where)
    kwargs: dict[str, Any]
    moe = None
    if model_type in LLAMA_FAMILY:
        bias = [k for k in ("attention_bias", "mlp_bias") if hf.get(k)]
        if bias:
            raise InteropError(f"{where}: {'/'.join(bias)}=true; megalm's Llama-style model has no biases")
        if hf["hidden_act"] != "silu":
            raise InteropError(f"{where}: hidden_act={hf['hidden_act']}; megalm's SwiGLU uses silu")
        hidden, heads = whole_number(hf, "hidden_size", where), whole_number(hf, "num_attention_heads", where)
        max_pos = whole_number(hf, "max_position_embeddings", where)
        rope_theta, rope_scaling = rope_from_hf(hf, where)
        kwargs = dict(norm="rmsnorm", activation="swiglu", position_embedding="rope", bias=False,
                      num_layers=whole_number(hf, "num_hidden_layers", where), hidden_size=hidden, num_heads=heads,
                      num_kv_heads=(whole_number(hf, "num_key_value_heads", where) if hf.get("num_key_value_heads")
                                    else heads),
                      ffn_hidden_size=whole_number(hf, "intermediate_size", where), norm_eps=float(hf["rms_norm_eps"]),
                      rope_theta=rope_theta, rope_scaling=RopeScalingConfig(**rope_scaling),
                      max_position_embeddings=max_pos,
                      tie_embeddings=bool(hf["tie_word_embeddings"]),
                      attention_dropout=float(hf["attention_dropout"]),
                      head_dim=whole_number(hf, "head_dim", where) if hf.get("head_dim") is not None else None)
        if model_type == QWEN2:  # q, k and v have biases (o_proj and the MLP none): no attention_bias key says so
            kwargs["qkv_bias"] = True
        if window is not None:
            kwargs["sliding_window"] = window
        if model_type not in DENSE_LLAMAS:
            try:
                extra, moe = moe_config_from_hf(hf, model_type)
            except MoEMappingError as e:
                raise InteropError(f"{where}: {e}") from None
            kwargs.update(extra)
    else:
        act = hf["activation_function"]
        if act not in GPT2_TANH_GELUS:
            raise InteropError(f"{where}: activation_function={act}; megalm's GELU is the tanh approximation "
                               f"({' or '.join(GPT2_TANH_GELUS)})")
        for key, wanted in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                            ("add_cross_attention", False)):
            if bool(hf.get(key, wanted)) != wanted:
                raise InteropError(f"{where}: {key}={hf[key]}; megalm's attention needs {key}={wanted}")
        if not hf["tie_word_embeddings"]:
            raise InteropError(f"{where}: tie_word_embeddings=false; megalm's GPT-2 style ties the head to wte")
        hidden = whole_number(hf, "n_embd", where)
        max_pos = whole_number(hf, "n_positions", where)
        kwargs = dict(norm="layernorm", activation="gelu", position_embedding="learned", bias=True,
                      tie_embeddings=True, num_layers=whole_number(hf, "n_layer", where), hidden_size=hidden,
                      num_heads=whole_number(hf, "n_head", where), num_kv_heads=whole_number(hf, "n_head", where),
                      ffn_hidden_size=whole_number(hf, "n_inner", where) if hf.get("n_inner") else 4 * hidden,
                      norm_eps=float(hf["layer_norm_epsilon"]), max_position_embeddings=max_pos,
                      dropout=float(hf["resid_pdrop"]), attention_dropout=float(hf["attn_pdrop"]))
    if max_pos < 1:  # (the run's seq_length is min(it, 2048): its error would name a key the file does not have)
        key = "max_position_embeddings" if model_type in LLAMA_FAMILY else "n_positions"
        raise InteropError(f"{where}: {key}={max_pos} must be >= 1; fix config.json")
    cfg = ModelConfig(name=f"hf-{model_type}", vocab_size=whole_number(hf, "vocab_size", where),
                      seq_length=min(max_pos, 2048),
                      init_std=float(hf["initializer_range"]), **kwargs)
    if moe is not None:
        cfg.moe = moe
    try:
        cfg = resolve_model_defaults(cfg)
        validate_model(cfg)
    except ConfigError as e:
        raise InteropError(f"{where}: {e}") from None
    return model_type, cfg


def _sliding_window(hf: Mapping[str, Any], given: Mapping[str, Any], model_type: str, where: str) -> int | None:
    """model.sliding_window of a config.json: Mistral's and Mixtral's `sliding_window` (every layer's); Qwen's
    where `use_sliding_window` puts it in every layer (`layer_types`, or `max_window_layers` 0). A window in some
    layers only, or one in an architecture transformers reads none for, is refused unless it reaches every earlier
    position (at least max_position_embeddings: the whole document's attention)."""
    window = hf.get("sliding_window")
    if model_type in WINDOWED:
        return None if window is None else whole_number(hf, "sliding_window", where)
    key = "use_sliding_window" if model_type in WINDOW_SWITCHED else "sliding_window"
    if not hf.get(key) or window is None:
        return None
    if model_type in WINDOW_SWITCHED:  # Qwen3-MoE's window is every layer's; Qwen2's and Qwen3's past max_window_layers
        layers = ["sliding_attention"] if model_type == QWEN3_MOE else hf.get("layer_types") or [
            "sliding_attention" if i >= hf["max_window_layers"] else "full_attention"
            for i in range(hf["num_hidden_layers"])]
        sliding = sum(kind == "sliding_attention" for kind in layers)
        if sliding == len(layers):
            return whole_number(hf, "sliding_window", where)
        if not sliding:
            return None
    positions = hf.get("max_position_embeddings")
    if isinstance(window, int | float) and isinstance(positions, int | float) and window >= positions:
        log.info(f"{where}: sliding_window={window} >= max_position_embeddings={positions} reaches every earlier "
                 "token: read as attention over the whole document")
        return None
    absent = f" (absent: transformers' default for {model_type}; set {key}: null in config.json if the model was " \
             "trained without a window)" if key not in given else ""
    raise InteropError(f"{where}: {key}={hf[key]} is set{absent}; megalm's window (model.sliding_window) is every "
                       "layer's, this one is " + ("some layers' only (max_window_layers)" if model_type in
                                                  WINDOW_SWITCHED else f"not one {model_type} computes"))


def model_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """`cfg` as the plain dict a checkpoint's config.yaml holds under `model`."""
    return asdict(cfg)


def run_overrides(cfg: ModelConfig) -> list[str]:
    """The `model.*` overrides that make a run's model the shape of `cfg` (to start it from these weights)."""
    keys = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size",
            "max_position_embeddings", "seq_length", "norm", "norm_eps", "activation", "position_embedding",
            "rope_theta", "tie_embeddings", "bias", "head_dim", "qk_norm", "qkv_bias")
    values = {k: getattr(cfg, k) for k in keys}
    if cfg.position_embedding != "rope":
        values.pop("rope_theta")
    if cfg.rope_scaling.type != "none":
        keys = LLAMA3_KEYS if cfg.rope_scaling.type == "llama3" else YARN_KEYS
        values.update({f"rope_scaling.{k}": getattr(cfg.rope_scaling, k) for k in ("type", *keys)})
    if cfg.moe.num_experts:
        values.update({f"moe.{k}": getattr(cfg.moe, k) for k in (
            "num_experts", "top_k", "expert_ffn_hidden_size", "first_k_dense", "every_n_layers", "norm_topk_prob",
            "aux_loss_coeff")})
    return [f"model.{k}={override_value(v)}" for k, v in values.items()]
