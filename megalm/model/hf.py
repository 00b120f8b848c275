"""The mapping between megalm's GPT and Hugging Face's LlamaForCausalLM / GPT2LMHeadModel: configs and tensors
(beyond Llama: Qwen3, Qwen3-MoE and Mixtral in hf_moe.py, RoPE scaling in hf_rope.py; reading a directory in
hf_files.py).

megalm's GPT is one module with two styles (megalm/model/gpt.py), and each style is exactly one `transformers`
architecture; the correspondence follows transformers' own modeling files (models/llama/modeling_llama.py,
models/gpt2/modeling_gpt2.py), which define what a key means:

    megalm                             LlamaForCausalLM                      GPT2LMHeadModel
    embedding.weight [:vocab]          model.embed_tokens.weight             transformer.wte.weight
    position_embedding.weight          -                                     transformer.wpe.weight
    layers.N.attention_norm.*          model.layers.N.input_layernorm.*      transformer.h.N.ln_1.*
    layers.N.attention.qkv_proj.*     model.layers.N.self_attn.{q,k,v}_proj transformer.h.N.attn.c_attn.* (T)
      (rows [q; k; v])
    layers.N.attention.o_proj.*        model.layers.N.self_attn.o_proj.*     transformer.h.N.attn.c_proj.* (T)
    layers.N.mlp_norm.*                model.layers.N.post_attention_layernorm transformer.h.N.ln_2.*
    layers.N.mlp.gate_up_proj.weight   model.layers.N.mlp.{gate,up}_proj.weight -
      (rows [gate; up])
    layers.N.mlp.up_proj.* (GELU)      -                                     transformer.h.N.mlp.c_fc.* (T)
    layers.N.mlp.down_proj.*           model.layers.N.mlp.down_proj.weight   transformer.h.N.mlp.c_proj.* (T)
    final_norm.*                       model.norm.weight                     transformer.ln_f.*
    output.weight [:vocab] (untied)    lm_head.weight                        - (tied to wte)

(T): GPT-2's Conv1D stores weights as [in, out], the transpose of nn.Linear's [out, in].
The fused projections (megalm/model/fused.py) are split into their parts before the per-tensor mapping and
concatenated after it (`unfuse_tensors` / `fuse_tensors`), so the table's unfused names are what the mapping
code reads (they are also how checkpoints store the parts).
No permutation of q/k is needed for RoPE: megalm rotates the two halves of each head (megalm/model/rope.py,
`rotate_half`), the convention HF Llama's `apply_rotary_pos_emb` uses for its own weight layout, with the same
frequencies theta^(-2i/D). GPT-2's MLP activation is exported as "gelu_pytorch_tanh", which is
F.gelu(approximate="tanh"), exactly megalm's GeluMLP; "gelu_new" (GPT-2's original name) is the same tanh
formula written out, equal up to float rounding, and is accepted on import.

Vocabulary: megalm pads the embedding and head rows past `vocab_size` (Megatron's rule); only the first
`vocab_size` rows are real, so export writes `weight[:vocab_size]` and import leaves padding to megalm.

Reading: hf_files.py's `read_hf_weights` (`HFWeights`, one tensor at a time) is what `model.init_from=hf:DIR`
(megalm/training/init_from.py) reads, its `read_hf_model` (all at once) what megalm-import
(megalm/interop/hf_import.py) writes; nothing here imports `transformers`. Writing a directory (atomic
output, shards) is the CLI's part, in megalm/interop/files.py.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict
from typing import Any

import torch

from megalm.config import ModelConfig, resolve_model_defaults, validate_model
from megalm.config.schema import RopeScalingConfig
from megalm.errors import ConfigError, InteropError
from megalm.model.fused import fuse_tensors, unfuse_tensors, unfused_names
from megalm.model.gpt import VOCAB_PARAMS
from megalm.model.hf_moe import (
    MIXTRAL,
    MOE_DEFAULTS,
    MOE_SUFFIXES,
    QWEN3,
    QWEN3_MOE,
    MoEMappingError,
    moe_architecture,
    moe_config_from_hf,
    moe_hf_config,
    moe_tensor_from_hf,
    moe_tensors_to_hf,
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
    QWEN2: {**_LLAMA_DEFAULTS, "max_position_embeddings": 32768, "num_key_value_heads": 32},
    QWEN3: {**_LLAMA_DEFAULTS, "max_position_embeddings": 32768, "head_dim": 128, "num_key_value_heads": 32},
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

# Per-layer names: megalm suffix -> HF Llama suffix (after "layers.N." / "model.layers.N.").
_LLAMA_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.q_proj.weight": "self_attn.q_proj.weight",
    "attention.k_proj.weight": "self_attn.k_proj.weight",
    "attention.v_proj.weight": "self_attn.v_proj.weight",
    "attention.o_proj.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
    "attention.q_proj.bias": "self_attn.q_proj.bias",  # Qwen2's (model.qkv_bias)
    "attention.k_proj.bias": "self_attn.k_proj.bias",
    "attention.v_proj.bias": "self_attn.v_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
_LLAMA_GLOBAL = {"embedding.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
# GPT-2: renamed as is (norms) or transposed (Conv1D weights); q, k, v are fused into c_attn separately.
_GPT2_LAYER_SAME = {"attention_norm": "ln_1", "mlp_norm": "ln_2"}
_GPT2_LAYER_CONV = {"attention.o_proj": "attn.c_proj", "mlp.up_proj": "mlp.c_fc", "mlp.down_proj": "mlp.c_proj"}
_GPT2_GLOBAL = {"embedding.weight": "transformer.wte.weight", "position_embedding.weight": "transformer.wpe.weight",
                "final_norm.weight": "transformer.ln_f.weight", "final_norm.bias": "transformer.ln_f.bias"}
# Buffers some HF checkpoints carry that are not weights (causal masks, rotary frequencies).
_IGNORED_HF_KEYS = re.compile(r"(^|\.)(attn\.bias|attn\.masked_bias|rotary_emb\.inv_freq)$")


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
        if cfg.sliding_window is not None and arch not in WINDOWED:
            raise InteropError(f"model.sliding_window={cfg.sliding_window} maps to MistralForCausalLM or Mixtral, "
                               f"which have neither q/k/v biases nor QK-norm; {ARCHITECTURES[arch]} attends whole")
        return arch
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
    # Qwen2 and Qwen3 configs carry a sliding_window that only use_sliding_window turns on
    windows = ("use_sliding_window",) if model_type in WINDOW_SWITCHED else ("sliding_window", "use_sliding_window")
    window, positions = hf.get("sliding_window"), hf.get("max_position_embeddings")
    if isinstance(window, int | float) and isinstance(positions, int | float) and window >= positions:
        windows, window = (), None  # no token is that far from another: the whole document
        log.info(f"{where}: sliding_window={hf['sliding_window']} >= max_position_embeddings={positions} reaches every "
                 "earlier token: read as attention over the whole document")
    elif model_type in WINDOWED and window is not None:  # every layer's (model.sliding_window)
        windows, window = ("use_sliding_window",), whole_number(hf, "sliding_window", where)
    else:
        window = None
    for key in windows:
        if hf.get(key):
            absent = f" (absent: transformers' default for {model_type}; set {key}: null in config.json if the model " \
                     "was trained without a window)" if key not in given else ""
            raise InteropError(f"{where}: {key}={hf[key]} is set{absent}; megalm attends over the whole document "
                               "(no sliding window)")
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


def model_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """`cfg` as the plain dict a checkpoint's config.yaml holds under `model`."""
    return asdict(cfg)


# ---------------------------------------------------------------------------- tensors


def _layer_of(name: str) -> tuple[int, str] | None:
    match = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    return (int(match[1]), match[2]) if match else None


def megalm_to_hf(tensors: Mapping[str, torch.Tensor], cfg: ModelConfig, arch: str) -> dict[str, torch.Tensor]:
    """HF state dict (contiguous tensors) from megalm's full-model parameters; vocab rows cut to `vocab_size`,
    a tied head written once (as the embedding, which transformers ties `lm_head` to)."""
    tensors = unfuse_tensors(tensors, cfg)
    out: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        if name in VOCAB_PARAMS:
            value = value[: cfg.vocab_size]
        layer = _layer_of(name)
        if arch in LLAMA_FAMILY:
            if layer is not None and layer[1] in MOE_SUFFIXES:
                out.update(moe_tensors_to_hf(arch, *layer, value))
                continue
            key = _LLAMA_GLOBAL[name] if layer is None else f"model.layers.{layer[0]}.{_LLAMA_LAYER[layer[1]]}"
            out[key] = value
            continue
        if layer is None:
            out[_GPT2_GLOBAL[name]] = value
            continue
        index, rest = layer
        module, _, leaf = rest.rpartition(".")
        prefix = f"transformer.h.{index}."
        if module in _GPT2_LAYER_SAME:
            out[prefix + f"{_GPT2_LAYER_SAME[module]}.{leaf}"] = value
        elif module in _GPT2_LAYER_CONV:
            out[prefix + f"{_GPT2_LAYER_CONV[module]}.{leaf}"] = value.t() if leaf == "weight" else value
        elif module == "attention.q_proj":  # c_attn = [q | k | v] along the output features
            parts = [tensors[f"layers.{index}.attention.{p}_proj.{leaf}"] for p in "qkv"]
            fused = torch.cat(parts, dim=0)
            out[prefix + f"attn.c_attn.{leaf}"] = fused.t() if leaf == "weight" else fused
        elif module not in ("attention.k_proj", "attention.v_proj"):
            raise InteropError(f"parameter {name} has no GPT-2 counterpart")
    return {k: v.contiguous() for k, v in out.items()}


def _strip_gpt2_prefix(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """{canonical "transformer.…"/"lm_head.…" key: stored key}: the original GPT-2 files store GPT2Model keys
    (no "transformer." prefix)."""
    return {k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}": k for k in tensors}


class HFWeights(Mapping[str, torch.Tensor]):
    """megalm's full-model parameters (fp32, unpadded vocab rows, fused names) from an HF state dict, each made when
    it is looked up: `model.init_from=hf:DIR` copies them into a rank's model one at a time, from files read one
    tensor at a time (hf_files.py's `SafetensorsDir`), so no rank holds the whole model in fp32.

    `shapes` are the megalm model's parameter shapes (names = the parameters to fill); `meta` the HF tensors'
    shapes and dtypes alone (meta tensors; taken from `tensors` when not given). Missing or unexpected tensors,
    shape mismatches and a head that contradicts tie_word_embeddings are refused in one line, each before a value
    is read, except a stored tied head that differs from the embedding: it is compared when the embedding is read.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], cfg: ModelConfig, arch: str,
                 shapes: Mapping[str, tuple[int, ...]], where: str,
                 meta: Mapping[str, torch.Tensor] | None = None) -> None:
        self._tensors, self._cfg, self._arch, self._where = tensors, cfg, arch, where
        self._keys = _strip_gpt2_prefix(tensors) if arch == GPT2 else {k: k for k in tensors}
        meta = {k: v.to("meta") for k, v in tensors.items()} if meta is None else meta
        unfused = unfuse_tensors({n: torch.empty(s, device="meta") for n, s in shapes.items()}, cfg)
        used: set[str] = set()
        out = {}
        for name in unfused:
            try:
                out[name] = self._value(name, lambda key: used.add(key) or meta[self._keys[key]])
            except RuntimeError as e:  # tensors that do not stack or concatenate (experts of other shapes)
                raise InteropError(f"{where}: {name} cannot be made of its tensors ({str(e).splitlines()[0][:150]}); "
                                   f"the files do not hold a {ARCHITECTURES[arch]} of config.json's shape") from None
        self._check_tied_head(out, meta, used)
        unexpected = sorted(k for k in self._keys if k not in used and not _IGNORED_HF_KEYS.search(k))
        if unexpected:
            more = f" (+{len(unexpected) - 3} more)" if len(unexpected) > 3 else ""
            raise InteropError(f"{where}: unexpected tensors {', '.join(unexpected[:3])}{more}; they do not belong "
                               f"to a {ARCHITECTURES[arch]} that megalm can compute")
        for name, value in out.items():
            expected = tuple(unfused[name].shape)
            if name in VOCAB_PARAMS:
                expected = (cfg.vocab_size, *expected[1:])
            if tuple(value.shape) != expected:
                raise InteropError(f"{where}: {name} has shape {tuple(value.shape)}, config.json implies {expected}")
        self._names = dict.fromkeys(fuse_tensors(out, cfg))  # the parts' rows checked against the model's

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        parts = unfused_names(name)
        if parts is None:
            value = self._value(name, self._read)
            if name == "embedding.weight" and self._cfg.tie_embeddings and "lm_head.weight" in self._keys:
                head = self._read("lm_head.weight")  # some files store the tied head too: it must be the embedding
                if not torch.equal(head, value):
                    raise InteropError(_TIED_HEAD_DIFFERS.format(where=self._where))
            return value
        return torch.cat([self._value(part, self._read) for part in parts])

    def __contains__(self, key: object) -> bool:  # (Mapping's would read the tensor)
        return key in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def _read(self, key: str) -> torch.Tensor:
        return self._tensors[self._keys[key]].to(torch.float32)

    def _check_tied_head(self, out: Mapping[str, torch.Tensor], meta: Mapping[str, torch.Tensor],
                         used: set[str]) -> None:
        if self._cfg.tie_embeddings and "lm_head.weight" in self._keys:
            if meta[self._keys["lm_head.weight"]].shape != out["embedding.weight"].shape:
                raise InteropError(_TIED_HEAD_DIFFERS.format(where=self._where))
            used.add("lm_head.weight")

    def _value(self, name: str, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """Unfused parameter `name` from the HF tensors `read(key)` returns (in fp32)."""
        where, arch, keys = self._where, self._arch, self._keys

        def get(key: str) -> torch.Tensor:
            if key == "lm_head.weight" and key not in keys:
                raise InteropError(f"{where}: tie_word_embeddings=false but the files hold no lm_head.weight; "
                                   "set tie_word_embeddings=true in config.json if the head is the embedding")
            if key not in keys:
                raise InteropError(f"{where}: tensor {key} is missing; the files do not hold a complete "
                                   f"{ARCHITECTURES[arch]}")
            return read(key).to(torch.float32)

        layer = _layer_of(name)
        if arch in LLAMA_FAMILY:
            if layer is not None and layer[1] in MOE_SUFFIXES:
                return moe_tensor_from_hf(arch, *layer, self._cfg.moe.num_experts, get)
            return get(_LLAMA_GLOBAL[name] if layer is None else f"model.layers.{layer[0]}.{_LLAMA_LAYER[layer[1]]}")
        if layer is None:
            return get(_GPT2_GLOBAL[name])
        index, rest = layer
        module, _, leaf = rest.rpartition(".")
        prefix = f"transformer.h.{index}."
        if module in _GPT2_LAYER_SAME:
            return get(prefix + f"{_GPT2_LAYER_SAME[module]}.{leaf}")
        if module in _GPT2_LAYER_CONV:
            value = get(prefix + f"{_GPT2_LAYER_CONV[module]}.{leaf}")
            return value.t().contiguous() if leaf == "weight" else value
        # q/k/v from c_attn: [in, 3 * out] (weight) or [3 * out] (bias)
        fused = get(prefix + f"attn.c_attn.{leaf}")
        fused = fused.t() if leaf == "weight" else fused
        if fused.shape[0] % 3:
            raise InteropError(f"{where}: {prefix}attn.c_attn.{leaf} of shape {tuple(fused.shape)} is not q|k|v")
        return fused.chunk(3, dim=0)["qkv".index(module.split(".")[1][0])].contiguous()


_TIED_HEAD_DIFFERS = ("{where}: tie_word_embeddings=true but lm_head.weight differs from the embedding; megalm "
                      "cannot tie them (set tie_word_embeddings=false in config.json if untied)")


def hf_to_megalm(tensors: Mapping[str, torch.Tensor], cfg: ModelConfig, arch: str,
                 shapes: Mapping[str, tuple[int, ...]], where: str) -> dict[str, torch.Tensor]:
    """`HFWeights`, every value read at once (megalm-import writes them all)."""
    return dict(HFWeights(tensors, cfg, arch, shapes, where).items())


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
        values.update({f"rope_scaling.{k}": "null" if getattr(cfg.rope_scaling, k) is None else
                       getattr(cfg.rope_scaling, k) for k in ("type", *keys)})
    if cfg.moe.num_experts:
        values.update({f"moe.{k}": getattr(cfg.moe, k) for k in (
            "num_experts", "top_k", "expert_ffn_hidden_size", "first_k_dense", "every_n_layers", "norm_topk_prob",
            "aux_loss_coeff")})
    return [f"model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items()]
