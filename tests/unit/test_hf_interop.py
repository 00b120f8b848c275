"""Hugging Face export / import: transformers loads the export cleanly and computes megalm's logits and greedy
generation; export(import(x)) and import(export(ckpt)) are exact; a checkpoint written under tp2 exports like
the one-process one; `model.init_from` starts training from the imported weights; bad inputs are refused in
one line without touching --out."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megalm.config import config_to_dict, validate
from megalm.data.tokenizer import build_tokenizer
from megalm.errors import MegalmError
from megalm.generate import sample
from megalm.interop import export as export_cli
from megalm.interop import hf_import as import_cli
from megalm.interop.export import export_hf
from megalm.interop.hf_import import import_hf
from megalm.model import GPT, init_weights
from megalm.model.hf import ARCHITECTURES, InteropError, architecture_of
from megalm.training.checkpoint import load_saved_model, read_checkpoint_meta, save_checkpoint
from megalm.training.init_from import read_megalm_weights
from tests.conftest import compose_config

transformers = pytest.importorskip("transformers")

STYLES = {
    "llama": ["model.num_kv_heads=2", "model.rope_theta=5000", "model.norm_eps=1e-6"],  # GQA, untied
    "llama_tied": ["model.num_kv_heads=2", "model.tie_embeddings=true"],
    "gpt2": ["model.norm=layernorm", "model.activation=gelu", "model.position_embedding=learned",
             "model.tie_embeddings=true", "model.bias=true", "model.num_kv_heads=4"],
    # Qwen3-MoE: QK-norm, a head_dim apart, a dense first block; Mixtral: experts in every block
    "qwen3_moe": ["model=moe_tiny", "model.num_layers=3", "model.hidden_size=64", "model.qk_norm=true",
                  "model.head_dim=24", "model.moe.first_k_dense=1", "model.moe.norm_topk_prob=true",
                  "model.moe.expert_ffn_hidden_size=32"],
    "mixtral": ["model=moe_tiny", "model.num_layers=2", "model.hidden_size=64", "model.moe.norm_topk_prob=true",
                "model.moe.expert_ffn_hidden_size=32"],
    "qwen2": ["model.num_kv_heads=2", "model.qkv_bias=true", "model.tie_embeddings=true"],  # trained biases
}


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory) -> str:
    """A small byte-level BPE tokenizer.json (vocab 300 < the model's 320) with GPT-2's end-of-text token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def hello(world): return world + 1\n" * 4, "the quick brown fox jumps"] * 20, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def make_run(run_dir: Path, style: str, tokenizer: str | None = None, seed: int = 3) -> tuple[Path, GPT]:
    """A run dir whose checkpoint holds random weights (norm weights and biases too, so a swapped mapping shows)."""
    cfg = validate(compose_config(*STYLES[style]))
    model = GPT(cfg.model)
    init_weights(model, seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
            if name in ("embedding.weight", "output.weight"):
                p[cfg.model.vocab_size:] = 0  # megalm's padded vocab rows (none until padding lands) stay zero
    optimizer = torch.optim.AdamW(model.parameters())
    save_checkpoint(run_dir, 5, model, optimizer, {"consumed_tokens": 0, "tokenizer": tokenizer},
                    config_to_dict(cfg), keep_last=1)
    return run_dir, model.eval()


def megalm_logits(model: GPT, ids: list[int]) -> torch.Tensor:
    n = len(ids)
    tokens = torch.tensor(ids)
    return model(tokens, torch.arange(n), torch.tensor([0, n], dtype=torch.int32), n)[:, : model.cfg.vocab_size]


def load_hf(path: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, output_loading_info=True, attn_implementation="eager", dtype=torch.float32)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs", "conversion_errors"):
        assert not info.get(key), f"transformers reports {key}: {info[key]}"
    return model.eval()


def assert_same_weights(weights: dict[str, torch.Tensor], model: GPT) -> None:
    """`weights` (a checkpoint's, padded for its own vocab rule) hold `model`'s parameters; padding rows are 0."""
    vocab = model.cfg.vocab_size
    for name, p in model.named_parameters():
        value = weights[name]
        if name in ("embedding.weight", "output.weight"):
            assert not value[vocab:].any(), f"{name}: padding rows must be zero"
            value, p = value[:vocab], p[:vocab]
        assert torch.equal(value, p.detach()), name


def files_tensors(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


@pytest.mark.parametrize("style", list(STYLES))
def test_export_matches_megalm_and_round_trips(tmp_path, style, hf_tokenizer):
    tokenizer = hf_tokenizer if style != "llama_tied" else "byte"
    run, model = make_run(tmp_path / "run", style, tokenizer)
    shard = "20KB" if style == "llama" else "5GB"  # the Llama export is sharded, the others one file
    out = export_hf(run, tmp_path / "hf", max_shard_size=shard)
    assert (out / "model.safetensors.index.json").is_file() == (style == "llama")
    hf_model = load_hf(out)
    assert type(hf_model).__name__ == ARCHITECTURES[style.removesuffix("_tied")]

    ids = torch.randint(0, model.cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        diff = (hf_model(torch.tensor([ids])).logits[0] - megalm_logits(model, ids)).abs().max().item()
    print(f"{style}: max abs logit difference megalm vs transformers = {diff:.3g}")
    assert diff <= 1e-4

    eod = build_tokenizer(tokenizer).eod_id
    prompt = ids[:5]
    ours = sample(model, prompt, 12, temperature=0, eod_id=eod)
    theirs = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                               attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=eod)
    assert theirs[0, len(prompt):].tolist() == ours

    if tokenizer != "byte":
        hf_tok = transformers.AutoTokenizer.from_pretrained(out)
        text = "def hello(world): the fox"
        assert hf_tok.encode(text, add_special_tokens=False) == build_tokenizer(tokenizer).encode(text)
        assert hf_tok.eos_token_id == eod
    else:
        assert not (out / "tokenizer.json").exists()

    # import(export(ckpt)) gives the checkpoint's weights; export(import(x)) gives x's tensors exactly.
    imported = import_hf(out, tmp_path / "imported")
    assert_same_weights(read_megalm_weights(imported)[2], model)
    again = export_hf(imported, tmp_path / "hf2")
    first, second = files_tensors(out), files_tensors(again)
    assert first.keys() == second.keys()
    for key, value in first.items():
        assert torch.equal(second[key], value), key
    assert json.loads((again / "config.json").read_text()) == json.loads((out / "config.json").read_text())
    if tokenizer != "byte":  # the import keeps the tokenizer (megalm-generate decodes with it), the export ships it
        spec = read_checkpoint_meta(imported).state["tokenizer"]
        assert Path(spec).parent == imported and build_tokenizer(spec).encode("the fox") == hf_tok.encode("the fox")
        assert (again / "tokenizer.json").read_bytes() == Path(tokenizer).read_bytes()


def save_under_tp2(rank: int, world_size: int, tmp: str, imported: str) -> None:
    from megalm.training.trainer import Trainer

    Trainer(compose_config("parallel.tp=2"), f"{tmp}/tp2").save()  # step 0: the layout-independent initial weights
    Trainer(compose_config(*STYLES["llama"], "parallel.tp=2", f"model.init_from={imported}"), f"{tmp}/init").save()


def test_tp2_checkpoint_exports_as_one_process_and_init_from_fills_tp_shards(tmp_path):
    """tp2 pads the vocab to 384 rows (320 on one rank) and splits heads: the export is the same, and a tp2 run
    started from an imported dir holds exactly the imported weights."""
    from megalm.training.trainer import Trainer
    from tests.dist.launch import run_distributed

    run, source = make_run(tmp_path / "src", "llama")
    imported = import_hf(export_hf(run, tmp_path / "hf"), tmp_path / "imported")
    run_distributed(save_under_tp2, 2, str(tmp_path), str(imported), timeout=120)
    assert len(list((tmp_path / "tp2" / "checkpoints" / "step_00000000").glob("shard-*"))) == 2
    Trainer(compose_config(), tmp_path / "one").save()
    a = files_tensors(export_hf(tmp_path / "tp2", tmp_path / "hf_tp2"))
    b = files_tensors(export_hf(tmp_path / "one", tmp_path / "hf_one"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert_same_weights(read_megalm_weights(tmp_path / "init")[2], source)


@pytest.mark.parametrize("via", ["import", "hf"])
def test_init_from_starts_training_from_the_imported_weights(tmp_path, via, caplog):
    from megalm.training.trainer import Trainer

    run, _ = make_run(tmp_path / "src", "llama")
    hf_dir = export_hf(run, tmp_path / "hf")
    source = str(import_hf(hf_dir, tmp_path / "imported")) if via == "import" else f"hf:{hf_dir}"
    common = [*STYLES["llama"], "trainer.max_steps=2"]

    reference = Trainer(compose_config(*common), tmp_path / "ref")  # the imported weights' loss on step 0's batch
    from megalm.training.checkpoint import load_model_weights

    load_model_weights(tmp_path / "imported" if via == "import" else import_hf(hf_dir, tmp_path / "imp"),
                       reference.model)
    loss, share = reference.forward_backward(0)
    expected = loss.item() / float(share.normaliser)  # a float: pytest 9.2 cannot approx a 0-d tensor

    with caplog.at_level(logging.INFO, logger="megalm"):
        summary = Trainer(compose_config(*common, f"model.init_from={source}"), tmp_path / "run").fit()
    assert summary.losses[0][1] == pytest.approx(expected, rel=1e-6)
    assert summary.losses[1][1] < summary.losses[0][1] + 1.0  # it trained on from there
    assert sum("model.init_from: weights from" in r.message for r in caplog.records) == 1


def test_init_from_refuses_another_shape_and_resume_refuses_an_import(tmp_path):
    from megalm.errors import MegalmError
    from megalm.training.trainer import Trainer

    run, _ = make_run(tmp_path / "src", "llama")
    with pytest.raises(MegalmError, match="num_kv_heads=2 .this run: 4.") as e:
        Trainer(compose_config("model.num_kv_heads=4", f"model.init_from={run}"), tmp_path / "run")
    assert "\n" not in str(e.value)
    assert "set the run's model.* to the source's" in str(e.value) and "hydra.run.dir" not in str(e.value)
    imported = import_hf(export_hf(run, tmp_path / "hf"), tmp_path / "imported")
    with pytest.raises(MegalmError, match="weights only .* model.init_from="):  # no optimizer state to resume
        Trainer(compose_config(*STYLES["llama"], f"trainer.resume={imported}"), tmp_path / "resumed")
    with pytest.raises(MegalmError, match=r"is a Hugging Face model dir \(config.json\); write model.init_from=hf:"):
        Trainer(compose_config(*STYLES["llama"], f"model.init_from={tmp_path / 'hf'}"), tmp_path / "no_prefix")


def test_init_from_takes_a_rope_model_to_a_longer_context(tmp_path, monkeypatch):
    """RoPE has no tensor of max_position_embeddings (it defaults to seq_length): a longer context starts from the
    shorter run's weights, as the guide says (it was refused as another model until 2026-12-06); a learned position
    table of another length is still refused, from the source's config alone (every rank read the whole source
    model into host memory first)."""
    from megalm.errors import MegalmError
    from megalm.training import init_from
    from megalm.training.trainer import Trainer

    run, model = make_run(tmp_path / "src", "llama")
    longer = Trainer(compose_config(*STYLES["llama"], "model.seq_length=64", f"model.init_from={run}"),
                     tmp_path / "run")
    assert torch.equal(longer.model.embedding.weight, model.embedding.weight)
    gpt2, _ = make_run(tmp_path / "gpt2", "gpt2")
    hf = export_hf(gpt2, tmp_path / "gpt2_hf")
    monkeypatch.setattr(init_from, "copy_init_weights", lambda *source: pytest.fail(f"read the weights of {source}"))
    for source in (gpt2, f"hf:{hf}"):
        with pytest.raises(MegalmError, match=r"max_position_embeddings=32 \(this run: 64\)"):
            Trainer(compose_config(*STYLES["gpt2"], "model.seq_length=64", f"model.init_from={source}"),
                    tmp_path / "g")


def test_init_from_refuses_weights_of_another_tokenizer(tmp_path, hf_tokenizer, caplog):
    """Weights trained on one tokenizer's ids, started on data of another's (the command megalm-import prints, run on
    the byte-level demo data), are refused in one line for a megalm checkpoint and an HF dir alike; they trained on
    without a word until 2026-12-06. The same tokenizer file elsewhere is the same tokenizer (by content)."""
    from megalm.data.preprocess import preprocess
    from megalm.errors import MegalmError
    from megalm.training.init_from import check_same_tokenizer
    from megalm.training.trainer import Trainer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    preprocess([corpus], str(tmp_path / "bytes"), "byte", show_progress=False)
    data = ["data=indexed", f"data.path={tmp_path / 'bytes'}", "data.valid_fraction=0"]
    run, _ = make_run(tmp_path / "src", "llama", hf_tokenizer)
    for source in (str(run), f"hf:{export_hf(run, tmp_path / 'hf')}"):
        with pytest.raises(MegalmError, match=r"was trained with tokenizer \S*tokenizer.json, this run's data is "
                           r"tokenized with byte; train on data preprocessed with its tokenizer") as e:
            Trainer(compose_config(*STYLES["llama"], *data, f"model.init_from={source}"), tmp_path / "run")
        assert "\n" not in str(e.value)
    byte_run, _ = make_run(tmp_path / "byte_src", "llama", "byte")
    Trainer(compose_config(*STYLES["llama"], *data, f"model.init_from={byte_run}"), tmp_path / "byte_run")
    copy = tmp_path / "copy" / "tokenizer.json"
    copy.parent.mkdir()
    shutil.copyfile(hf_tokenizer, copy)
    check_same_tokenizer("x", hf_tokenizer, str(copy))
    resaved = tmp_path / "resaved.json"  # the same vocabulary in other bytes (another tokenizers version's file)
    resaved.write_text(json.dumps(json.loads(Path(hf_tokenizer).read_text()), indent=4))
    check_same_tokenizer("x", hf_tokenizer, str(resaved))
    with caplog.at_level(logging.INFO, logger="megalm"):
        check_same_tokenizer("x", str(tmp_path / "gone.json"), "byte")
    assert "not both on this machine; not compared" in caplog.text


def _hf_dir(tmp_path: Path, style: str = "llama") -> Path:
    run, _ = make_run(tmp_path / f"src-{style}", style)
    return export_hf(run, tmp_path / f"good-{style}")


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


BAD_IMPORTS = {
    "rope_scaling": (lambda d: _edit_config(d, rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_scaling"),
    "attention_bias": (lambda d: _edit_config(d, attention_bias=True), "attention_bias=true"),
    "sliding_window": (lambda d: _edit_config(d, sliding_window=16), "sliding_window"),
    "head_dim": (lambda d: _edit_config(d, head_dim=8), "config.json implies"),  # weights of another head_dim
    "model_type": (lambda d: _edit_config(d, model_type="gemma"), "model_type='gemma'"),
    "tie_mismatch": (lambda d: _edit_config(d, tie_word_embeddings=True), "lm_head.weight differs"),
    "missing_config": (lambda d: (d / "config.json").unlink(), "no config.json"),
    "missing_shard": (lambda d: next(d.glob("model-00002-*.safetensors")).unlink(), "which is missing"),
    "pickle_only": (lambda d: [f.unlink() for f in d.glob("model*.safetensors*")]
                    and (d / "pytorch_model.bin").write_bytes(b"pickle"), "pickle"),
    # tracebacks until 2026-12-04 (an audit): a config that is not a mapping, a key the architecture needs, a value
    # of another type, an index whose weight map is a list
    "config_a_list": (lambda d: (d / "config.json").write_text("[1, 2]"), "is a JSON list, not a model config"),
    "config_lacks_a_key": (lambda d: (d / "config.json").write_text(json.dumps(
        {k: v for k, v in json.loads((d / "config.json").read_text()).items() if k != "hidden_size"})),
        "lacks 'hidden_size'"),
    "config_wrong_type": (lambda d: _edit_config(d, hidden_size="abc"), "hidden_size='abc' must be a whole number"),
    "config_wrong_float": (lambda d: _edit_config(d, rms_norm_eps="abc"), "holds a value of the wrong type"),
    # int() dropped the fraction, and the layers past it were reported missing (found by an audit)
    "config_fractional": (lambda d: _edit_config(d, num_hidden_layers=2.5), "num_hidden_layers=2.5 must be a whole"),
    # json reads Infinity, on which int() raised its own OverflowError
    "config_infinite": (lambda d: _edit_config(d, num_hidden_layers=float("inf")),
                        "num_hidden_layers=inf must be a whole"),
    # named as model.seq_length=0, a key the file does not have
    "config_no_positions": (lambda d: _edit_config(d, max_position_embeddings=0),
                            "max_position_embeddings=0 must be >= 1"),
    "index_map_a_list": (lambda d: (d / "model.safetensors.index.json").write_text('{"weight_map": [1]}'),
                         "is not a safetensors index"),
}


@pytest.mark.parametrize("case", list(BAD_IMPORTS))
def test_import_refuses_bad_inputs_in_one_line(tmp_path, case, capsys):
    hf_dir = tmp_path / "hf"
    run, _ = make_run(tmp_path / "src", "llama")
    export_hf(run, hf_dir, max_shard_size="20KB")
    edit, message = BAD_IMPORTS[case]
    edit(hf_dir)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("untouched")
    with pytest.raises(SystemExit) as e:
        import_cli.main([str(hf_dir), "--out", str(out), "--overwrite"])
    err = capsys.readouterr().err.strip()
    assert e.value.code != 0 and "\n" not in err and message in err, err
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "untouched"
    assert not list(tmp_path.glob(".out.*")), "no temporary directory is left behind"


@pytest.mark.parametrize("case", ["tie_mismatch", "truncated_shard"])
def test_init_from_refuses_bad_files_in_one_line(tmp_path, case):
    """`model.init_from=hf:DIR` reads the files one tensor at a time (tests/unit/test_load_memory.py): what only
    a tensor's bytes show (a stored tied head that is not the embedding, a cut shard) is still one line."""
    from megalm.training.trainer import Trainer

    hf_dir = tmp_path / "hf"
    run, _ = make_run(tmp_path / "src", "llama")
    export_hf(run, hf_dir, max_shard_size="20KB")
    if case == "tie_mismatch":
        BAD_IMPORTS[case][0](hf_dir)
    else:
        shard = next(hf_dir.glob("model-00002-*.safetensors"))
        shard.write_bytes(shard.read_bytes()[:-64])
    tied = ["model.tie_embeddings=true"] if case == "tie_mismatch" else []
    message = "lm_head.weight differs" if case == "tie_mismatch" else "is not a readable safetensors file"
    with pytest.raises(MegalmError, match=message) as e:
        Trainer(compose_config(*STYLES["llama"], *tied, f"model.init_from=hf:{hf_dir}"), tmp_path / "run")
    assert "\n" not in str(e.value)


def test_init_from_reads_each_file_tensor_once(tmp_path, monkeypatch):
    """`HFWeights` builds a tensor when it is looked up: a membership test must not build it too (Mapping's
    `__contains__` does, and every tensor of the files was read and converted twice, a second reader found)."""
    from megalm.model.hf_files import SafetensorsDir
    from megalm.training.trainer import Trainer

    hf_dir = _hf_dir(tmp_path, "llama_tied")
    reads: dict[str, int] = {}
    getitem = SafetensorsDir.__getitem__

    def counted(self, key):
        reads[key] = reads.get(key, 0) + 1
        return getitem(self, key)

    monkeypatch.setattr(SafetensorsDir, "__getitem__", counted)
    Trainer(compose_config(*STYLES["llama_tied"], f"model.init_from=hf:{hf_dir}"), tmp_path / "run")
    assert reads and reads.keys() == files_tensors(hf_dir).keys() and set(reads.values()) == {1}, reads


def test_import_names_experts_that_do_not_stack(tmp_path):
    """An expert weight of another shape in a Qwen3-MoE file: one line naming the parameter (it was torch.stack's
    RuntimeError, found by a second reader)."""
    hf_dir, _ = transformers_dir(tmp_path / "hf", "qwen3_moe")
    file = next(hf_dir.glob("*.safetensors"))
    tensors = load_file(str(file))
    key = next(k for k in tensors if k.endswith("experts.1.gate_proj.weight"))
    tensors[key] = tensors[key][:-1].clone()
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(InteropError, match=r"layers\.1\.mlp\.experts\.gate_up_proj\.weight cannot be made of its "
                       "tensors .* the files do not hold a Qwen3MoeForCausalLM") as error:
        import_hf(hf_dir, tmp_path / "out")
    assert "\n" not in str(error.value)


def test_export_refuses_bad_inputs_in_one_line(tmp_path, capsys):
    run, _ = make_run(tmp_path / "src", "llama")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("untouched")
    cases = [([str(run), "--out", str(out)], "exists and is not empty"),  # no --overwrite
             ([str(tmp_path / "nope"), "--out", str(out), "--overwrite"], "does not exist")]
    # Llama style with biases, and GELU with RoPE: no transformers architecture computes them
    for override, message in (("model.bias=true", "model.bias=true"), ("model.activation=gelu", "activation=gelu")):
        cfg = validate(compose_config(override))
        model = GPT(cfg.model)
        init_weights(model, 0)
        save_checkpoint(tmp_path / override, 1, model, torch.optim.AdamW(model.parameters()), {"consumed_tokens": 0},
                        config_to_dict(cfg), keep_last=1)
        cases.append(([str(tmp_path / override), "--out", str(out), "--overwrite"], message))
    for argv, message in cases:
        with pytest.raises(SystemExit) as e:
            export_cli.main(argv)
        err = capsys.readouterr().err.strip()
        assert e.value.code != 0 and "\n" not in err and message in err, err
        assert [p.name for p in out.iterdir()] == ["keep.txt"]
    # --overwrite replaces it once the new directory is complete
    export_cli.main([str(run), "--out", str(out), "--overwrite"])
    assert (out / "model.safetensors").is_file() and not (out / "keep.txt").exists()


def _tree(path: Path) -> dict[str, bytes]:
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


def test_export_and_import_refuse_an_out_that_is_or_holds_their_input(tmp_path, capsys):
    """`--overwrite` replaces --out whole: pointed at the input, or a directory above it, it would delete the very
    model being converted. Both tools refuse in one line and leave the input as it was."""
    run, _ = make_run(tmp_path / "runs" / "src", "llama")
    hf_dir = export_hf(run, tmp_path / "hf")
    step = next((run / "checkpoints").glob("step_*"))
    cases = [(export_cli, [str(run), "--out", str(run)], run, "is the input"),
             (export_cli, [str(step), "--out", str(run)], run, "or holds it"),
             (export_cli, [str(run), "--out", str(tmp_path / "runs")], run, "or holds it"),
             # a dir of runs reads its newest run's latest checkpoint, which --out holds
             (export_cli, [str(tmp_path / "runs"), "--out", str(run)], run, "or holds it"),
             (import_cli, [str(hf_dir), "--out", str(hf_dir)], hf_dir, "is the input")]
    for cli, argv, source, message in cases:
        before = _tree(source)
        with pytest.raises(SystemExit) as e:
            cli.main([*argv, "--overwrite"])
        err = capsys.readouterr().err.strip()
        assert e.value.code != 0 and "\n" not in err and message in err and "choose another --out" in err, err
        assert _tree(source) == before, f"{argv}: the input changed"


def test_export_and_import_name_an_out_they_cannot_write_in_one_line(tmp_path, capsys):
    """An --out under a file (or on a read-only disk) was an OSError's traceback: one line now, exit 2."""
    run, _ = make_run(tmp_path / "src", "llama")
    hf_dir = export_hf(run, tmp_path / "hf")
    (tmp_path / "notes.txt").write_text("mine")
    for cli, source in ((export_cli, run), (import_cli, hf_dir)):
        with pytest.raises(SystemExit) as e:
            cli.main([str(source), "--out", str(tmp_path / "notes.txt" / "out")])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and err.startswith("error: ") and "\n" not in err and "notes.txt" in err, err
        # it said "File exists: .../notes.txt" (an audit, 2026-12-06)
        assert f"{tmp_path / 'notes.txt'} is a file, so the directory cannot be made there" in err, err
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_import_accepts_original_gpt2_key_names_and_gelu_new(tmp_path):
    """The original GPT-2 files store GPT2Model keys (no "transformer." prefix), the causal-mask buffers and
    activation_function=gelu_new; they import to the same weights."""
    run, model = make_run(tmp_path / "src", "gpt2")
    hf_dir = export_hf(run, tmp_path / "hf")
    tensors = load_file(str(hf_dir / "model.safetensors"))
    legacy = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    legacy["h.0.attn.bias"] = torch.ones(1, 1, 32, 32)
    save_file(legacy, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    _edit_config(hf_dir, activation_function="gelu_new")
    assert_same_weights(read_megalm_weights(import_hf(hf_dir, tmp_path / "imported"))[2], model)


QWEN3_STYLES = {
    "qwen3": ("Qwen3", dict(head_dim=24)),
    "qwen3_moe": ("Qwen3Moe", dict(head_dim=24, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                   mlp_only_layers=[0], norm_topk_prob=True)),
    "mixtral": ("Mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2": ("Qwen2", {}),  # Llama's with q/k/v biases (perturbed like every tensor: not zeros)
}


def transformers_dir(path: Path, style: str) -> tuple[Path, object]:
    """A tiny random model saved by transformers itself (its own key names, dtype and config), norms perturbed."""
    torch.manual_seed(0)
    if style == "llama":
        config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          rope_theta=5000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
        model = transformers.LlamaForCausalLM(config)
    elif style in QWEN3_STYLES:  # head_dim apart from hidden / heads; Qwen3-MoE: a dense first block
        kind, kwargs = QWEN3_STYLES[style]
        config = getattr(transformers, f"{kind}Config")(
            vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=1,
            eos_token_id=2, **kwargs)
        model = getattr(transformers, f"{kind}ForCausalLM")(config)
    else:
        config = transformers.GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                         bos_token_id=0, eos_token_id=0)  # activation_function: gelu_new
        model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return path, model.eval()


@pytest.mark.parametrize("style", ["llama", "gpt2", *QWEN3_STYLES])
def test_import_of_a_transformers_save_computes_its_logits_and_exports_back_exactly(tmp_path, style):
    """transformers' own save (Qwen3-MoE and Mixtral: experts per expert on disk) -> megalm-import -> the loaded
    model's logits equal transformers'; -> megalm-export -> the same tensors, which transformers loads."""
    hf_dir, hf_model = transformers_dir(tmp_path / "hf", style)
    imported = import_hf(hf_dir, tmp_path / "imported")
    _, model = load_saved_model(imported)  # as megalm-generate loads it (MoE: the routers' bias buffers too)
    model.eval()
    assert type(hf_model).__name__ == ARCHITECTURES[style if style in QWEN3_STYLES else style]
    assert bool(model.cfg.moe.num_experts) == (style in ("qwen3_moe", "mixtral"))
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        diff = (hf_model(torch.tensor([ids])).logits[0] - megalm_logits(model, ids)).abs().max().item()
    print(f"{style}: imported from transformers, max abs logit difference = {diff:.3g}")
    assert diff <= 1e-5

    again = export_hf(imported, tmp_path / "again")
    original, exported = files_tensors(hf_dir), files_tensors(again)
    tied = {"lm_head.weight"} if style == "gpt2" else set()  # a tied head is stored once (as wte)
    assert exported.keys() == original.keys() - tied
    for key, value in exported.items():
        assert torch.equal(value, original[key]), key
    config = json.loads((again / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == ((0, 0) if style == "gpt2" else (1, 2))
    load_hf(again)


def test_bf16_directory_round_trips_exactly_in_its_own_dtype(tmp_path):
    hf_dir, hf_model = transformers_dir(tmp_path / "hf", "llama")
    hf_model.to(torch.bfloat16).save_pretrained(hf_dir)
    again = export_hf(import_hf(hf_dir, tmp_path / "imported"), tmp_path / "again")  # --dtype auto: bfloat16
    original, exported = files_tensors(hf_dir), files_tensors(again)
    assert exported.keys() == original.keys()
    for key, value in exported.items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, original[key]), key


@pytest.mark.parametrize(("change", "message"), [
    (dict(mlp_only_layers=[1]), "mlp_only_layers=\\[1\\] are not the first blocks"),
    # Qwen's use_sliding_window puts Qwen3-MoE's window in every layer: one shorter than the context's positions
    # imports (tests/unit/test_sliding_window.py); this config's positions are 64
    (dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], use_sliding_window=True, sliding_window=16,
          max_window_layers=1), "use_sliding_window=True is set; megalm's window .* some layers' only"),
    (dict(model_type="qwen2_moe"), "model_type='qwen2_moe' is not supported"),
    # it named model.moe.norm_topk_prob=false, a training setting no import takes (an audit, 2026-12-06)
    (dict(num_experts_per_tok=1, norm_topk_prob=True), "megalm does not import top-1 routing with norm_topk_prob")])
def test_import_refuses_moe_layouts_megalm_cannot_compute(tmp_path, change, message):
    hf_dir, _ = transformers_dir(tmp_path / "hf", "qwen3_moe")
    _edit_config(hf_dir, **change)
    with pytest.raises(InteropError, match=message) as error:
        import_hf(hf_dir, tmp_path / "out")
    assert "\n" not in str(error.value) and not (tmp_path / "out").exists()


def test_import_refuses_a_top_1_mixtral_naming_no_training_setting(tmp_path):
    """Mixtral always renormalises its top-k: at top-1 every combine weight is 1 (the router learns nothing). The
    refusal named model.moe.norm_topk_prob=false, a training setting no import takes (an audit, 2026-12-06)."""
    run, _ = make_run(tmp_path / "run", "mixtral")
    out = export_hf(run, tmp_path / "hf")
    _edit_config(out, num_experts_per_tok=1)
    with pytest.raises(InteropError, match="megalm does not import top-1 routing with norm_topk_prob .Mixtral") as e:
        import_hf(out, tmp_path / "imported")
    assert "model.moe" not in str(e.value) and not (tmp_path / "imported").exists()


def test_export_refuses_moe_models_without_an_hf_counterpart(tmp_path):
    cfg = validate(compose_config(*STYLES["qwen3_moe"], "model.moe.num_shared_experts=1",
                                  "model.moe.router_score=sigmoid")).model
    with pytest.raises(InteropError, match="num_shared_experts=1.*|router_score=sigmoid") as error:
        architecture_of(cfg)
    assert "router_score=sigmoid" in str(error.value) and "num_shared_experts=1" in str(error.value)


@pytest.mark.parametrize("style", ["llama", "gpt2", *QWEN3_STYLES])
def test_the_command_import_prints_starts_training_from_the_import(tmp_path, style, caplog):
    """megalm-import ends with the megalm-train command that continues pretraining from its output; its overrides
    give the imported model's structure, which `model.init_from` checks key by key (qk-norm, head size and MoE
    layers since 2026-12-04): the command builds and starts from the weights, whatever the architecture."""
    from megalm.training.trainer import Trainer

    hf_dir, _ = transformers_dir(tmp_path / "hf", style)
    with caplog.at_level(logging.INFO, logger="megalm"):
        import_hf(hf_dir, tmp_path / "imported")
    line = next(r.getMessage() for r in caplog.records if "continue pretraining from it" in r.getMessage())
    overrides = line.split("megalm-train ", 1)[1].split()
    trainer = Trainer(compose_config(*overrides, "model.seq_length=32", "trainer.max_steps=1"), tmp_path / "run")
    weights = read_megalm_weights(tmp_path / "imported")[2]
    for name, p in trainer.model.named_parameters():
        if name not in ("embedding.weight", "output.weight"):
            assert torch.equal(p.detach(), weights[name]), name


def test_a_single_file_beside_a_stale_index_is_read_as_transformers_reads_it(tmp_path, caplog):
    """save_pretrained sharded, then unsharded into the same dir, leaves the old index beside model.safetensors:
    transformers reads the single file, megalm read the index (other weights, or a refusal naming a lost shard)."""
    run, _ = make_run(tmp_path / "src", "llama")
    sharded = export_hf(run, tmp_path / "hf", max_shard_size="20KB")
    other, _ = make_run(tmp_path / "other", "llama", seed=9)
    single = export_hf(other, tmp_path / "single")
    (sharded / "model.safetensors").write_bytes((single / "model.safetensors").read_bytes())
    with caplog.at_level(logging.WARNING, logger="megalm"):
        out = import_hf(sharded, tmp_path / "out")
    assert "model.safetensors is read, as transformers reads it" in caplog.text
    imported = read_megalm_weights(out)[2]
    expected = read_megalm_weights(import_hf(single, tmp_path / "out-single"))[2]
    assert imported.keys() == expected.keys() and all(torch.equal(imported[k], expected[k]) for k in expected)


def test_export_reads_the_checkpoints_file_headers_once(tmp_path, monkeypatch):
    """megalm-export reads a block at a time (megalm/training/checkpoint/load.py, SavedModelParts); a reader made for
    each read would read every file's header again, every rank's optimizer keys among them (minutes at 70B saved by
    64 ranks, found by a second reader). One reader reads them once."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    run, _ = make_run(tmp_path / "src", "mixtral")  # routers' buffers too: read by the same reader
    reads = []
    original = HuggingFaceStorageReader.read_metadata
    monkeypatch.setattr(HuggingFaceStorageReader, "read_metadata", lambda self: reads.append(1) or original(self))
    export_hf(run, tmp_path / "hf")
    assert len(reads) == 1


def test_export_refuses_what_hugging_face_cannot_compute(tmp_path):
    """A learned router selection bias (kept by model.init_from from an aux-loss-free run, bias_update_rate 0 now):
    export dropped it without a word and the HF model routed otherwise; a GPT-2 head_dim apart from hidden/heads
    exported a directory transformers cannot load."""
    cfg = validate(compose_config(*STYLES["mixtral"])).model
    model = GPT(cfg)
    init_weights(model, 0)
    model.layers[0].mlp.router.expert_bias.copy_(torch.linspace(-1, 1, cfg.moe.num_experts))
    full = validate(compose_config(*STYLES["mixtral"]))
    save_checkpoint(tmp_path / "run", 1, model, torch.optim.AdamW(model.parameters()), {"consumed_tokens": 0},
                    config_to_dict(full), keep_last=1)
    with pytest.raises(InteropError, match=r"layers.0.mlp.router.expert_bias \(\+0 more\) holds a learned"):
        export_hf(tmp_path / "run", tmp_path / "out")
    gpt2 = validate(compose_config(*STYLES["gpt2"], "model.head_dim=8")).model
    with pytest.raises(InteropError, match="head_dim=8 != hidden_size/num_heads"):
        architecture_of(gpt2)
    for extra in ("model.qk_norm=true", "model.moe.num_experts=4"):  # Qwen2 has neither
        qwen2 = validate(compose_config(*STYLES["qwen2"], extra)).model
        with pytest.raises(InteropError, match="model.qkv_bias=true maps to Qwen2ForCausalLM"):
            architecture_of(qwen2)


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_a_config_without_its_optional_keys_reads_as_transformers_reads_it(model_type):
    """A config.json that omits a key means transformers' default for its architecture. Every omitted key took
    Llama's before: a hand-written Mixtral config got rms_norm_eps 1e-6 and rope_theta 1e4 (Mixtral's are 1e-5
    and 1e6), a Qwen3 one head_dim = hidden / heads (Qwen3's is 128), a Qwen3-MoE one top-2 routing (top-8)."""
    from megalm.model.hf import HF_DEFAULTS, model_config_from_hf

    config_class = transformers.AutoConfig.for_model(model_type).__class__
    # 64 heads of 64: Qwen3's head_dim default (128) then differs from hidden / heads, and its kv heads default (32)
    # from the heads
    full = config_class(**({} if model_type == "gpt2" else {"hidden_size": 4096, "num_attention_heads": 64})).to_dict()
    if model_type == "mistral":  # its default window (4,096 of 32,768 positions) is read from a bare config too
        _, windowed = model_config_from_hf({k: v for k, v in full.items() if k != "sliding_window"}, "bare")
        assert windowed.sliding_window == 4096
        full["sliding_window"] = None  # Mistral 7B v0.2 and v0.3, NeMo: no window; said, so kept in the bare one
    bare = {k: v for k, v in full.items()
            if (k not in HF_DEFAULTS[model_type] or k == "sliding_window") and k != "rope_parameters"}
    assert len(bare) < len(full) - 5, sorted(full)
    _, read_full = model_config_from_hf(full, "full")
    _, read_bare = model_config_from_hf(bare, "bare")
    assert read_bare == read_full


def test_export_of_a_model_with_a_capacity_says_transformers_routes_dropless(tmp_path, monkeypatch, caplog):
    """megalm drops past an expert's capacity in evaluation and generation too; Mixtral's and Qwen3-MoE's routers
    have no capacity. The export was silent (0.02 logit difference at capacity_factor=0.5); it now says so."""
    monkeypatch.setitem(STYLES, "mixtral_capacity", [*STYLES["mixtral"], "model.moe.capacity_factor=0.5"])
    with caplog.at_level(logging.WARNING, logger="megalm"):
        export_hf(make_run(tmp_path / "capacity", "mixtral_capacity")[0], tmp_path / "hf")
        export_hf(make_run(tmp_path / "dropless", "mixtral")[0], tmp_path / "hf_dropless")
    warned = [r.message for r in caplog.records if "capacity_factor" in r.message]
    assert len(warned) == 1 and "capacity_factor=0.5: MixtralForCausalLM routes without a capacity" in warned[0]


def _bpe_tokenizer(path: Path, specials: list[str], vocab: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def hello(world): return world + 1\n" * 4, "the quick brown fox jumps"] * 20, trainer)
    path.mkdir(parents=True)
    tok.save(str(path / "tokenizer.json"))
    return str(path / "tokenizer.json")


def test_an_export_s_token_files_agree_and_a_tokenizer_of_another_vocabulary_is_refused(tmp_path):
    """An imported Llama (bos <s> = 1, eos </s> = 2) exported again: tokenizer_config.json named the eod token as bos,
    so AutoTokenizer's bos id was 2 where generation_config.json said 1; exported with another --tokenizer, the
    import's ids were kept though that tokenizer's end of text is another id; and a --tokenizer larger than the
    model's vocabulary was shipped, its ids past the embedding (an audit, 2026-12-06)."""
    hf_dir, _ = transformers_dir(tmp_path / "hf", "llama")
    shutil.copy(_bpe_tokenizer(tmp_path / "llama_tok", ["<unk>", "<s>", "</s>"], 300), hf_dir / "tokenizer.json")
    imported = import_hf(hf_dir, tmp_path / "imported")
    out = export_hf(imported, tmp_path / "again")
    tokens = json.loads((out / "tokenizer_config.json").read_text())
    assert (tokens["bos_token"], tokens["eos_token"]) == ("<s>", "</s>")
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2}
    auto = transformers.AutoTokenizer.from_pretrained(out)
    assert (auto.bos_token_id, auto.eos_token_id) == (1, 2)
    gpt = _bpe_tokenizer(tmp_path / "gpt_tok", ["<|endoftext|>"], 300)
    other = export_hf(imported, tmp_path / "other", tokenizer=gpt)
    assert json.loads((other / "generation_config.json").read_text()) == {"bos_token_id": 0, "eos_token_id": 0}
    tokens = json.loads((other / "tokenizer_config.json").read_text())
    assert (tokens["bos_token"], tokens["eos_token"]) == ("<|endoftext|>", "<|endoftext|>")
    from tests.unit.test_data import make_hf_tokenizer

    big = str(make_hf_tokenizer(tmp_path / "big.json", [f"w{i}" for i in range(700)]))
    with pytest.raises(InteropError, match=r"has 702 tokens, the run's had at most 300: it is not the one"):
        export_hf(imported, tmp_path / "big", tokenizer=big)
    assert not (tmp_path / "big").exists()


def test_generation_from_an_imported_llama_starts_its_prompt_as_its_tokenizer_does(tmp_path, capsys):
    """megalm encodes text without special tokens (its documents start after an eod); Llama's tokenizer puts <s>
    before every text, and Hugging Face's generate continues that. megalm-generate sampled an imported Llama from a
    prompt without it, a context the model never saw (an audit, 2026-12-06): now it prints what transformers does."""
    from tokenizers import Tokenizer, processors

    from megalm.generate import continuation, load_for_generation
    from megalm.generate import main as generate_main

    hf_dir, hf_model = transformers_dir(tmp_path / "hf", "llama")
    tok = Tokenizer.from_file(_bpe_tokenizer(tmp_path / "llama_tok", ["<unk>", "<s>", "</s>"], 300))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    imported = import_hf(hf_dir, tmp_path / "imported")
    text = "def hello"
    ids = transformers.AutoTokenizer.from_pretrained(hf_dir)(text).input_ids
    model, tokenizer, stops, start, _ = load_for_generation(str(imported))
    assert ids[0] == 1 and start + tokenizer.encode(text) == ids
    theirs = hf_model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                               attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=2)[0, len(ids):]
    generate_main([str(imported), "--prompt", text, "--temperature", "0", "--max-new-tokens", "6"])
    assert capsys.readouterr().out == text + continuation(tokenizer, ids, theirs.tolist()) + "\n"
    assert load_for_generation(str(imported), tokenizer="byte").start == []  # another tokenizer: its own start
    # <s> alone is a trained context (a byte-level model's empty prompt is refused: test_cli), as transformers has it
    theirs = hf_model.generate(torch.tensor([[1]]), max_new_tokens=4, do_sample=False, pad_token_id=2,
                               attention_mask=torch.ones(1, 1, dtype=torch.long))[0, 1:]
    generate_main([str(imported), "--prompt", "", "--temperature", "0", "--max-new-tokens", "4"])
    assert capsys.readouterr().out == continuation(tokenizer, [1], theirs.tolist()) + "\n"


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


SCALED_ROPES = {  # (transformers config class, its rope_scaling) at head_dim 16, theta 5,000, an original context of 32
    "llama3": ("Llama", LLAMA3_ROPE),
    "yarn": ("Qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),  # Qwen3's 128K
    # DeepSeek's attention factor from an mscale pair, a ramp of other bounds, not rounded out to whole pairs
    "yarn_mscale": ("Llama", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                              "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2,
                              "truncate": False}),
}


@pytest.mark.parametrize("kind", list(SCALED_ROPES))
def test_a_scaled_rope_imports_computes_its_logits_and_exports_back(tmp_path, kind):
    """Llama 3.1/3.2/3.3's rope_scaling (rope_type llama3) and YaRN (Qwen's long-context configs) import as
    model.rope_scaling: the logits equal transformers' past the original 32 positions (at head_dim 16 and theta 5,000
    the 8 frequencies fall in every band: kept, interpolated, divided by the factor), where the unscaled RoPE's do
    not; the export carries it back, and transformers computes the same from it."""
    torch.manual_seed(0)
    family, rope = SCALED_ROPES[kind]
    config = getattr(transformers, f"{family}Config")(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rope_theta=5000.0, rope_scaling=dict(rope),
        tie_word_embeddings=False)
    hf_model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    hf_model.save_pretrained(tmp_path / "hf")
    imported = import_hf(tmp_path / "hf", tmp_path / "imported")
    _, model = load_saved_model(imported)
    model.eval()
    scaling = model.cfg.rope_scaling
    assert (scaling.type, scaling.factor, scaling.original_max_position_embeddings) == (rope["rope_type"], rope[
        "factor"], 32)
    ids = torch.randint(0, 300, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0]
        assert (expected - megalm_logits(model, ids)).abs().max().item() <= 1e-5
        scaling.type = "none"  # the same weights under plain RoPE: another function past the first positions
        assert (expected - megalm_logits(model, ids)).abs().max().item() > 1e-3
    again = export_hf(imported, tmp_path / "again")
    config = json.loads((again / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == config["rope_scaling"]["rope_type"] == rope["rope_type"]
    with torch.no_grad():
        assert (load_hf(again)(torch.tensor([ids])).logits[0] - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("rope_scaling, message", [
    ({"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 32}, "rope_type 'longrope'"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "partial_rotary_factor": 0.5},
     "sets partial_rotary_factor"),
    # YaRN in DeepSeek's form (its factor from the original context) without that context: transformers 5 takes
    # the model's own, a factor of 1
    ({"rope_type": "yarn", "beta_fast": 32.0}, "lacks factor"),
    ({**LLAMA3_ROPE, "factor": "eight"}, "its factors must be numbers"),
    ({**LLAMA3_ROPE, "low_freq_factor": 4.0}, "low_freq_factor=4.0 must be below high_freq_factor=4.0"),
    # transformers 5 reads rope_parameters, 4 rope_scaling: two that disagree would be two models
    ({**LLAMA3_ROPE, "factor": 32.0, "rope_parameters": {**LLAMA3_ROPE, "rope_theta": 5000.0}}, "disagree"),
    ({"rope_type": "default", "rope_parameters": {**LLAMA3_ROPE, "rope_theta": 5000.0}}, "disagree"),
], ids=["longrope", "partial_yarn", "no_yarn_factor", "not_a_number", "empty_band", "two_factors", "two_types"])
def test_import_refuses_a_rope_scaling_it_cannot_compute(tmp_path, rope_scaling, message):
    hf_dir = _hf_dir(tmp_path)
    rope_scaling = dict(rope_scaling)
    _edit_config(hf_dir, rope_parameters=rope_scaling.pop("rope_parameters", None), rope_scaling=rope_scaling)
    with pytest.raises(MegalmError, match=message):
        import_hf(hf_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("outer", [None, 256, 32])
def test_a_scaled_rope_without_its_original_context_reads_as_transformers_5_reads_it(tmp_path, outer, caplog):
    """rope_scaling llama3 without original_max_position_embeddings (transformers 4 raised KeyError; it was refused
    until 2026-12-07): transformers 5 takes max_position_embeddings, and so does the import, saying so once; the
    logits equal transformers' on the file. A top-level original_max_position_embeddings that disagrees is refused:
    transformers 5's AutoConfig leaves it out, its model classes read it (a second reader found megalm read it)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rope_theta=5000.0,
        rope_scaling=dict(LLAMA3_ROPE), tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    without = {k: v for k, v in LLAMA3_ROPE.items() if k != "original_max_position_embeddings"}
    _edit_config(tmp_path / "hf", rope_parameters={**without, "rope_theta": 5000.0},  # as transformers 5 writes it
                 **({"original_max_position_embeddings": outer} if outer else {}))
    if outer == 32:  # (transformers' AutoConfig reads 256 from this file, its model class 32: ambiguous)
        with pytest.raises(InteropError, match="original_max_position_embeddings=32 stands outside rope_parameters"):
            import_hf(tmp_path / "hf", tmp_path / "imported")
        return
    hf_model = load_hf(tmp_path / "hf")
    assert hf_model.config.rope_parameters["original_max_position_embeddings"] == 256
    with caplog.at_level(logging.INFO, logger="megalm"):
        imported = import_hf(tmp_path / "hf", tmp_path / "imported")
    assert "has no original_max_position_embeddings: max_position_embeddings=256 is read" in caplog.text
    _, model = load_saved_model(imported)
    model.eval()
    assert model.cfg.rope_scaling.original_max_position_embeddings == 256
    ids = torch.randint(0, 300, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        assert (hf_model(torch.tensor([ids])).logits[0] - megalm_logits(model, ids)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("keys", [
    {"rope_scaling": LLAMA3_ROPE, "rope_parameters": {**LLAMA3_ROPE, "rope_theta": 5000.0}},
    {"rope_scaling": LLAMA3_ROPE, "rope_parameters": {**LLAMA3_ROPE, "rope_theta": 5000.0}, "rope_theta": 7000.0},
    {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0},
    {"rope_parameters": {**LLAMA3_ROPE, "rope_theta": 5000.0}, "rope_theta": 7000.0},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}},
    {"rope_scaling": {**LLAMA3_ROPE, "rope_theta": 1e6}, "rope_theta": 5e5}],  # the legacy dict's own: a reader found
    ids=["both", "both_top", "4", "5_top", "5", "legacy_own"])
def test_rope_theta_reads_as_transformers_reads_it(keys):
    """rope_theta where config.json spells it more than once: with a (legacy) rope_scaling, transformers 5 reads its
    own rope_theta, else the top-level one (or the default), else rope_parameters'; megalm read rope_parameters'
    first."""
    import copy

    from megalm.model.hf import model_config_from_hf

    base = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
    theirs = transformers.LlamaConfig.from_dict({**base, **copy.deepcopy(keys)}).rope_parameters["rope_theta"]
    assert model_config_from_hf({**base, **copy.deepcopy(keys)}, "d")[1].rope_theta == theirs


def test_a_mistral_with_a_sliding_window_imports_with_its_logits_and_exports_as_mistral(tmp_path):
    """Mistral 7B v0.1's sliding window (16 of 128 positions here) imports as model.sliding_window: the logits of 120
    tokens equal transformers' (and differ without the window); the export is a MistralForCausalLM with the window,
    the same tensors and logits."""
    torch.manual_seed(0)
    config = transformers.MistralConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                        max_position_embeddings=128, sliding_window=16, rope_theta=1e6)
    hf_model = transformers.MistralForCausalLM(config).eval()
    hf_model.save_pretrained(tmp_path / "hf")
    imported = import_hf(tmp_path / "hf", tmp_path / "imported")
    _, model = load_saved_model(imported)
    model.eval()
    assert model.cfg.sliding_window == 16
    ids = torch.randint(0, 300, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0]
        assert (expected - megalm_logits(model, ids)).abs().max().item() <= 1e-5
    again = export_hf(imported, tmp_path / "again")
    exported = json.loads((again / "config.json").read_text())
    assert (exported["architectures"], exported["sliding_window"]) == (["MistralForCausalLM"], 16)
    assert {k: torch.equal(v, files_tensors(again)[k]) for k, v in files_tensors(tmp_path / "hf").items()} == \
        dict.fromkeys(files_tensors(again), True)
    with torch.no_grad():
        assert (load_hf(again)(torch.tensor([ids])).logits[0] - expected).abs().max().item() <= 1e-5
        for module in model.modules():  # the same weights attending whole documents: another function
            if hasattr(module, "window"):
                module.window = None
        assert (expected - megalm_logits(model, ids)).abs().max().item() > 1e-3


def test_a_mistral_without_its_window_imports_as_the_llama_style_and_exports_as_llama(tmp_path):
    """MistralForCausalLM with sliding_window null (Mistral 7B v0.2/v0.3, NeMo) is Llama's model: it imports with
    transformers' logits, and exports as LlamaForCausalLM with the same tensors and logits."""
    torch.manual_seed(0)
    config = transformers.MistralConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                        max_position_embeddings=128, sliding_window=None, rope_theta=1e6)
    hf_model = transformers.MistralForCausalLM(config).eval()
    hf_model.save_pretrained(tmp_path / "hf")
    imported = import_hf(tmp_path / "hf", tmp_path / "imported")
    _, model = load_saved_model(imported)
    model.eval()
    ids = torch.randint(0, 300, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0]
        assert (expected - megalm_logits(model, ids)).abs().max().item() <= 1e-5
    again = export_hf(imported, tmp_path / "again")
    assert json.loads((again / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    exported = files_tensors(again)
    assert {k: torch.equal(v, exported[k]) for k, v in files_tensors(tmp_path / "hf").items()} == dict.fromkeys(
        exported, True)
    with torch.no_grad():
        assert (load_hf(again)(torch.tensor([ids])).logits[0] - expected).abs().max().item() <= 1e-5


def test_yarn_keys_read_as_transformers_reads_them(tmp_path):
    """truncate: null does not truncate (transformers reads get("truncate", True)); a top-level
    original_max_position_embeddings that contradicts the scaling's is refused (transformers 5 reads the top-level
    one); a Mistral config without sliding_window has transformers' default window, 4,096."""
    from megalm.model.hf import model_config_from_hf

    base = {"model_type": "qwen3", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "max_position_embeddings": 256, "rope_theta": 5000.0}
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    _, cfg = model_config_from_hf({**base, "rope_scaling": {**yarn, "truncate": None}}, "d")
    assert cfg.rope_scaling.truncate is False
    with pytest.raises(InteropError, match="original_max_position_embeddings=64 and rope_scaling's 32 disagree"):
        model_config_from_hf({**base, "rope_scaling": yarn, "original_max_position_embeddings": 64}, "d")
    mistral = {**base, "model_type": "mistral", "max_position_embeddings": 32768}
    assert model_config_from_hf(mistral, "d")[1].sliding_window == 4096  # transformers' default for mistral
    # Mistral keeps its window, even one as long as its positions (a longer context, later, would see past it)
    assert model_config_from_hf({**mistral, "max_position_embeddings": 4096}, "d")[1].sliding_window == 4096
