"""What a resume or a `model.init_from` start checks and carries over, beyond weights and moments: a checkpoint of
another model structure is refused (qk-norm, head size, MoE layers: DCP reads only what the model asks for, so a
tensor with no place in it would be dropped without a word), settings that change later steps' samples are refused,
the optimizer's settings are this run's (said in one line where they differ), and an MoE router's learned selection
bias comes along with the weights. Each case was found by an audit on 2026-12-04, where it resumed or started
silently."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from megalm.config import config_to_dict, validate
from megalm.errors import CheckpointError
from megalm.training.trainer import Trainer
from tests.conftest import compose_config

RUN = ["trainer.max_steps=4", "trainer.save_interval=2"]
MOE = ["model.moe.num_experts=4", "model.moe.expert_ffn_hidden_size=32"]


def stopped_at_2(run_dir, *overrides: str) -> None:
    Trainer(compose_config(*RUN, "trainer.stop_at_step=2", *overrides), run_dir).fit()


@pytest.mark.parametrize("saved, resumed, named", [
    (["model.qk_norm=true"], ["model.qk_norm=false"], "qk_norm=True (this run: False)"),
    (["model.head_dim=32"], [], "head_dim=32 (this run: 16)"),
    ([*MOE, "model.moe.num_shared_experts=1"], [*MOE, "model.moe.num_shared_experts=0"],
     "moe.num_shared_experts=1 (this run: 0)"),
    (MOE, [], "moe.num_experts=4 (this run: 0)"),
], ids=["qk_norm", "head_dim", "shared_experts", "experts"])
def test_a_checkpoint_of_another_structure_is_refused(tmp_path, saved, resumed, named):
    stopped_at_2(tmp_path, *saved)
    with pytest.raises(CheckpointError, match="is from another model") as error:
        Trainer(compose_config(*RUN, *resumed), tmp_path)
    assert named in str(error.value) and "\n" not in str(error.value)


def test_the_same_structure_spelled_otherwise_resumes(tmp_path):
    """head_dim left unset or set to hidden_size / num_heads is one structure."""
    stopped_at_2(tmp_path)
    assert Trainer(compose_config(*RUN, "model.head_dim=16"), tmp_path).step == 2


@pytest.mark.parametrize("overrides", [["data.split_seed=7"], ["data.valid_fraction=0.2"],
                                       ["model.seq_length=24", "model.max_position_embeddings=32"],
                                       ["data.synthetic.num_docs=300"]], ids=lambda o: o[0])
def test_settings_that_change_later_samples_are_refused(tmp_path, overrides):
    stopped_at_2(tmp_path, "model.max_position_embeddings=32")
    with pytest.raises(CheckpointError, match="resuming would change the data order"):
        Trainer(compose_config(*RUN, *overrides), tmp_path)


def test_under_a_token_budget_the_unread_batch_size_may_change(tmp_path):
    """trainer.tokens_per_step takes as many samples a step as fit it, whatever trainer.global_batch_size says: a
    resume that changes the batch size was refused as changing the data order, which it does not."""
    budget = ["data.varlen=true", "trainer.tokens_per_step=96"]
    stopped_at_2(tmp_path / "run", *budget, "trainer.global_batch_size=4")
    resumed = Trainer(compose_config(*RUN, *budget, "trainer.global_batch_size=8"), tmp_path / "run")
    straight = Trainer(compose_config(*RUN, *budget), tmp_path / "straight")
    assert resumed.step == 2 and all(resumed.step_sample_ids(s) == straight.step_sample_ids(s) for s in range(2, 4))


def test_the_optimizer_s_settings_are_this_run_s_and_a_change_is_said(tmp_path, caplog):
    """Lowering beta2 (a usual answer to a divergence) takes effect on resume, with one warning; the moments are the
    checkpoint's. Until 2026-12-04 the checkpoint's param groups were restored whole, over the config."""
    stopped_at_2(tmp_path)
    with caplog.at_level(logging.WARNING, logger="megalm"):
        trainer = Trainer(compose_config(*RUN, "optim.beta2=0.99", "optim.eps=1e-6"), tmp_path)
    for group in trainer.optimizer.param_groups:
        assert tuple(group["betas"]) == (0.9, 0.99) and group["eps"] == 1e-6
    said = [r.getMessage() for r in caplog.records if "optimizer settings differ" in r.getMessage()]
    assert len(said) == 1 and "betas=[0.9, 0.95] (this run: [0.9, 0.99])" in said[0], said
    assert any(s for s in trainer.optimizer.state.values())  # the moments came from the checkpoint
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megalm"):
        Trainer(compose_config(*RUN), tmp_path)
    assert not [r for r in caplog.records if "optimizer settings differ" in r.getMessage()]


def test_init_from_carries_the_routers_learned_selection_bias(tmp_path):
    """An MoE router's selection bias (a persistent buffer, learned by the bias updates) routes tokens as much as
    its weights do: a start from a checkpoint takes it too, where it had started from zeros."""
    balanced = [*MOE, "model.moe.bias_update_rate=0.05"]
    source = Trainer(compose_config("trainer.max_steps=3", *balanced), tmp_path / "source")
    source.fit()
    bias = [layer.mlp.router.expert_bias for layer in source.model.layers]
    assert any(b.abs().sum() > 0 for b in bias)
    started = Trainer(compose_config("trainer.max_steps=3", *balanced, f"model.init_from={tmp_path / 'source'}"),
                      tmp_path / "started")
    for layer, expected in zip(started.model.layers, bias, strict=True):
        assert torch.equal(layer.mlp.router.expert_bias, expected)


def test_a_checkpoint_of_skipped_steps_only_resumes(tmp_path, monkeypatch, caplog):
    """trainer.nonfinite=skip skipped every update before the save (a preemption during non-finite first steps):
    torch's AdamW had no state to save, and the resume asked the checkpoint for moments it never held ("corrupt or
    from another model"). It resumes, and says AdamW starts afresh."""
    from megalm.training import guards

    real = guards.NonFiniteGuard.should_skip
    monkeypatch.setattr(guards.NonFiniteGuard, "should_skip",
                        lambda self, step, loss, norm: real(self, step, float("nan"), norm))
    stopped_at_2(tmp_path)
    monkeypatch.undo()
    with caplog.at_level(logging.INFO, logger="megalm"):
        trainer = Trainer(compose_config(*RUN), tmp_path)
    assert trainer.step == 2 and "holds no optimizer state" in caplog.text
    trainer.fit()
    assert trainer.optimizer.state  # the next steps update


def test_a_changed_learning_rate_schedule_is_said_with_both_rates(tmp_path, caplog):
    """lr_at follows this run's settings: a resume with a longer max_steps re-stretches a cosine (a 6.7x jump of the
    learning rate in one step) or with another optim.lr jumps, without a word; it now names the keys and both rates.
    The same schedule resumes without the line."""
    from megalm.training.optim import lr_at

    stopped_at_2(tmp_path, "optim.warmup_steps=1")
    with caplog.at_level(logging.WARNING, logger="megalm"):
        Trainer(compose_config(*RUN, "optim.warmup_steps=1"), tmp_path)
    assert "learning rate" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megalm"):
        trainer = Trainer(compose_config("trainer.max_steps=40", "trainer.save_interval=2", "optim.warmup_steps=1"),
                          tmp_path)
    lines = [r.message for r in caplog.records if "on this run's schedule" in r.message]
    now, was = lr_at(2, trainer.cfg.optim, 40), lr_at(2, trainer.cfg.optim, 4)
    assert len(lines) == 1 and "trainer.max_steps=4 (this run: 40)" in lines[0], caplog.text
    assert f"step 3 runs at learning rate {now:.4g} on this run's schedule, {was:.4g} on the checkpoint's" in lines[0]


def test_an_all_expert_model_has_no_dense_width_to_match(tmp_path):
    """Every block with experts: no tensor has ffn_hidden_size, so it is not part of the structure (a Mixtral-style
    run's own HF export, whose width is the experts', was refused as another model)."""
    from megalm.training.checkpoint.verify import check_model_config, model_structure

    saved = config_to_dict(validate(compose_config("model=moe_tiny", "model.ffn_hidden_size=32")))["model"]
    current = config_to_dict(validate(compose_config("model=moe_tiny", "model.ffn_hidden_size=192")))["model"]
    assert "ffn_hidden_size" not in model_structure(saved)
    check_model_config(saved, current, tmp_path)
    with pytest.raises(CheckpointError, match="ffn_hidden_size"):  # a dense first block holds it
        check_model_config({**saved, "moe": {**saved["moe"], "first_k_dense": 1}},
                           {**current, "moe": {**current["moe"], "first_k_dense": 1}}, tmp_path)


def test_q_k_v_biases_are_one_structure_however_they_are_asked_for(tmp_path):
    """model.bias puts biases in q, k and v as model.qkv_bias does: a GPT-2-style run with either or both holds the
    same tensors (it was refused as another model); a Llama-style model with q/k/v biases is another than one
    without."""
    from megalm.training.checkpoint.verify import check_model_config

    gpt2 = ["model=gpt2_tiny"]
    both = config_to_dict(validate(compose_config(*gpt2, "model.qkv_bias=true")))["model"]
    check_model_config(config_to_dict(validate(compose_config(*gpt2)))["model"], both, tmp_path)
    llama = config_to_dict(validate(compose_config()))["model"]
    with pytest.raises(CheckpointError, match="qkv_bias"):
        check_model_config(llama, {**llama, "qkv_bias": True}, tmp_path)


def test_init_from_says_when_the_routers_route_otherwise(tmp_path, caplog):
    """model.init_from named rope_theta or norm_eps changes; another top_k or norm_topk_prob of the same experts
    passed without a word."""
    stopped_at_2(tmp_path / "src", "model=moe_tiny")
    with caplog.at_level(logging.WARNING, logger="megalm"):
        Trainer(compose_config(*RUN, "model=moe_tiny", "model.moe.top_k=1", "model.moe.norm_topk_prob=false",
                               f"model.init_from={tmp_path / 'src'}"), tmp_path / "run")
    assert "moe.top_k=2 (this run: 1)" in caplog.text, caplog.text


def test_a_checkpoint_with_a_model_key_this_megalm_lacks_is_one_line_naming_its_file(tmp_path):
    """A newer megalm's checkpoint (a model key this one lacks) read by megalm-generate, megalm-export or
    model.init_from: one line naming its config.yaml and the way to read it (it was OmegaConf's three lines,
    without the file: its ConfigKeyError is no ValidationError)."""
    from megalm.training.checkpoint import latest_checkpoint, load_saved_model
    from megalm.training.init_from import read_init_source

    stopped_at_2(tmp_path / "run")
    config = latest_checkpoint(tmp_path / "run") / "config.yaml"
    config.write_text(config.read_text().replace("model:\n", "model:\n  a_newer_key: 1\n", 1))
    for read in (lambda: load_saved_model(tmp_path / "run"), lambda: read_init_source(str(tmp_path / "run"))):
        with pytest.raises(CheckpointError) as error:
            read()
        message = str(error.value)
        assert "\n" not in message and str(config) in message and "'a_newer_key'" in message, message
        assert "read it with the megalm version that wrote it" in message


def test_a_resume_on_data_rebuilt_in_place_is_said(tmp_path, caplog):
    """The checkpoint keeps the data's documents and tokens: a resume on a dataset rebuilt under the same data.path
    (other documents) goes on, saying that its samples and validation split are no longer the run's (it went on
    without a word, an audit, 2026-12-06); on the same data nothing is said."""
    import json

    from megalm.data.preprocess import preprocess

    def corpus(docs: int) -> None:
        text = "".join(json.dumps({"text": f"document {i} " * (3 + i % 7)}) + "\n" for i in range(docs))
        (tmp_path / "docs.jsonl").write_text(text)
        preprocess([tmp_path / "docs.jsonl"], str(tmp_path / "corpus"), "byte", show_progress=False, overwrite=True)

    data = ["data=indexed", f"data.path={tmp_path / 'corpus'}", "data.valid_fraction=0.1"]
    corpus(60)
    stopped_at_2(tmp_path / "run", *data)
    for docs, said in ((60, False), (70, True)):
        corpus(docs)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="megalm"):
            Trainer(compose_config(*RUN, *data), tmp_path / "run")
        lines = [m for m in caplog.messages if "the data changed since" in m]
        assert len(lines) == int(said), caplog.messages
    assert "trained on data of 60 documents" in lines[0] and "this run's has 70 and" in lines[0], lines

    # the same data copied elsewhere (a node's local disk) resumes, said in one line: the path was compared as a
    # string and refused as a change of data order, which only a new run dir escaped (an audit, 2026-12-06); other
    # data at another path (70 documents, the checkpoint's 60) is still refused
    (tmp_path / "local").mkdir()
    for name in ("corpus.bin", "corpus.idx"):
        shutil.copy(tmp_path / name, tmp_path / "local" / name)
    elsewhere = [*data[:1], f"data.path={tmp_path / 'local' / 'corpus'}", *data[2:]]
    with pytest.raises(CheckpointError, match="trained with path=.*, this run has .*local/corpus; resuming would"):
        Trainer(compose_config(*RUN, *elsewhere), tmp_path / "run")
    corpus(60)
    for name in ("corpus.bin", "corpus.idx"):
        shutil.copy(tmp_path / name, tmp_path / "local" / name)
    moved = [*data[:1], f"data.path={tmp_path / 'local' / 'corpus'}", *data[2:]]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megalm"):
        assert Trainer(compose_config(*RUN, *moved), tmp_path / "run").step == 2
    said = [m for m in caplog.messages if "this run reads" in m]
    assert len(said) == 1 and f"this run reads {tmp_path / 'local' / 'corpus'}: resumed as the same data" in said[0]
    with pytest.raises(CheckpointError, match="seed=1234, this run has 1"):  # what does fix the order is still refused
        Trainer(compose_config(*RUN, *moved, "seed=1"), tmp_path / "run")


def test_a_resume_names_another_drop_policy_only_where_experts_drop():
    """model.moe.drop_policy changes which assignments a capacity drops: a resume names it, as it names
    capacity_factor. A checkpoint written before the key drops by position, and a dropless model reads no policy."""
    from megalm.training.checkpoint.verify import FUNCTION_KEYS, TRAINING_KEYS, function_differences

    def model(*overrides: str) -> dict:
        return config_to_dict(validate(compose_config("model=moe_tiny", *overrides)))["model"]

    keys = FUNCTION_KEYS + TRAINING_KEYS
    capacity = model("model.moe.capacity_factor=1.0")
    probs = model("model.moe.capacity_factor=1.0", "model.moe.drop_policy=probs")
    assert function_differences(capacity, probs, keys) == ["moe.drop_policy=position (this run: probs)"]
    before_the_key = {**capacity, "moe": {k: v for k, v in capacity["moe"].items() if k != "drop_policy"}}
    assert function_differences(before_the_key, capacity, keys) == []
    assert function_differences(model(), model("model.moe.drop_policy=probs"), keys) == []
