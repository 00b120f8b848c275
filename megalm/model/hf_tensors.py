"""The tensors of the Hugging Face mapping (hf.py has the configs): megalm's full-model parameters to an HF state
dict (`megalm_to_hf`) and back, one tensor when it is looked up (`HFWeights`) or all (`hf_to_megalm`).

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
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping

import torch

from megalm.config import ModelConfig
from megalm.errors import InteropError
from megalm.model.fused import fuse_tensors, unfuse_tensors, unfused_names
from megalm.model.gpt import VOCAB_PARAMS
from megalm.model.hf import ARCHITECTURES, GPT2, LLAMA_FAMILY
from megalm.model.hf_moe import MOE_SUFFIXES, moe_tensor_from_hf, moe_tensors_to_hf

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
            return read(key)

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
