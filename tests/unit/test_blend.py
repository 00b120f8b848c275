"""Dataset blends (`data.blend`): proportions, sample i a function of (seed, i), exact resume, one-line errors.

The components are tiny indexed datasets written here, each with its tokens in its own id range, so a sample
shows which component it came from.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from megalm.config import MegalmConfig, validate
from megalm.data.blend import BlendedDataset, blend_period, blend_quotas
from megalm.data.build import build_datasets
from megalm.data.dataset import (
    PackedDataset,
    VarlenDataset,
    global_batch,
    split_documents,
)
from megalm.data.indexed import IndexedDataset, IndexedDatasetWriter
from megalm.data.steps import TokenBudgetSteps
from megalm.errors import CheckpointError, ConfigError, DataError
from megalm.training.metrics import read_metrics
from megalm.training.trainer import Trainer
from tests.conftest import compose_config

RANGE = 50  # component c holds token ids [c*RANGE, (c+1)*RANGE); 256 is the byte tokenizer's eod


def write_component(prefix: Path, c: int, num_docs: int = 60, vocab_size: int = 257, eod_id: int = 256,
                    spec: str = "byte") -> str:
    rng = np.random.default_rng([c, 99])
    with IndexedDatasetWriter(str(prefix), vocab_size, spec, eod_id=eod_id) as w:
        for _ in range(num_docs):
            w.add_document(rng.integers(c * RANGE, (c + 1) * RANGE, size=int(rng.integers(5, 60))))
        w.finalize()
    return str(prefix)


@pytest.fixture
def prefixes(tmp_path) -> list[str]:
    return [write_component(tmp_path / name, c) for c, name in enumerate("abc")]


def config(blend, seq_length: int = 16, seed: int = 1234, varlen: bool = False,
           valid_fraction: float = 0.1) -> MegalmConfig:
    cfg = MegalmConfig(seed=seed)
    cfg.model.seq_length = seq_length
    cfg.data.name, cfg.data.blend, cfg.data.varlen, cfg.data.valid_fraction = "indexed", blend, varlen, valid_fraction
    return cfg


def component_of(tokens: np.ndarray) -> int:
    """Which component a sample came from (its non-eod tokens all lie in that component's range)."""
    ids = {int(t) // RANGE for t in tokens if t != 256}
    assert len(ids) == 1, f"a sample mixes components {ids}"
    return ids.pop()


# ------------------------------------------------------------------------------- the interleave rule


def test_quotas_are_exact_ratios_when_they_can_be():
    assert blend_quotas([0.3, 0.7]) == [3, 7]
    assert blend_quotas([2, 2]) == [1, 1]
    assert blend_quotas([1 / 3, 2 / 3]) == [1, 2]
    assert blend_quotas([0.2, 0.3, 0.5]) == [2, 3, 5]
    weights = np.array([0.1234567, 0.2345671, 0.3456781])  # no small exact ratio: 10^6 by largest remainder
    quotas = blend_quotas(weights.tolist())
    assert sum(quotas) == 10**6
    np.testing.assert_allclose(np.array(quotas) / sum(quotas), weights / weights.sum(), rtol=0, atol=1e-6)
    with pytest.raises(DataError, match="below 1/1000000"):
        blend_quotas([1e-9, 1.0 + 1e-7])


@pytest.mark.parametrize("weights, bound", [([0.3, 0.7], 0.5), ([0.2, 0.3, 0.5], 1.0), ([1, 1, 1], 1.0),
                                            ([0.123456789, 0.2, 0.676543211], 1.0), ([0.001, 1, 1, 1, 5], 1.5)])
def test_every_prefix_is_within_about_one_sample_of_the_weights(weights, bound):
    quotas = blend_quotas(weights)
    component, rank = blend_period(quotas)
    n = 3 * len(component)
    seq = np.concatenate([component] * 3)
    counts = np.eye(len(quotas))[seq].cumsum(0)  # counts[N-1, d]: samples of d among the first N
    ideal = np.outer(np.arange(1, n + 1), np.array(weights) / sum(weights))
    assert np.abs(counts - ideal).max() <= bound + 1e-6 * n  # + the rounding of weights to quotas
    # rank = how many earlier samples of the same component the period holds
    for d, q in enumerate(quotas):
        assert rank[component == d].tolist() == list(range(q))


def test_sample_i_is_its_components_own_jth_sample(prefixes):
    """locate(i) = (d, j) with j = how many earlier blend samples came from d, and the sample is exactly sample j
    of d's standalone sampler (its own split and seeded shuffle)."""
    cfg = config([0.2, prefixes[0], 0.3, prefixes[1], 0.5, prefixes[2]])
    train = build_datasets(cfg).train
    assert isinstance(train, BlendedDataset) and train.weights == [0.2, 0.3, 0.5]
    standalone = []
    for p in prefixes:
        source = IndexedDataset(p)
        train_ids, _ = split_documents(len(source), 0.1, 0)
        standalone.append(PackedDataset(source, train_ids, 16, cfg.seed))
    seen = [0, 0, 0]
    for i in range(300):
        d, j = train.locate(i)
        assert j == seen[d]
        seen[d] += 1
        np.testing.assert_array_equal(train[i].tokens, standalone[d][j].tokens)
        assert train[i].doc_lengths == standalone[d][j].doc_lengths
    d, j = train.locate(10**12 + 7)  # any index, no replay: O(1)
    assert j == (10**12 + 7) // 10 * train.quotas[d] + int(train._rank[(10**12 + 7) % 10])


def test_achieved_proportions_of_the_samples_match_the_weights(prefixes):
    train = build_datasets(config([0.2, prefixes[0], 0.3, prefixes[1], 0.5, prefixes[2]])).train
    n = 1000
    seq = np.array([component_of(train[i].tokens) for i in range(n)])  # read from the tokens themselves
    counts = np.eye(3)[seq].cumsum(0)
    ideal = np.outer(np.arange(1, n + 1), [0.2, 0.3, 0.5])
    assert np.abs(counts - ideal).max() <= 1.0, "every prefix of N samples holds each component within 1 of w*N"
    assert counts[-1].tolist() == [200, 300, 500]


def test_one_component_blend_is_the_plain_dataset(prefixes):
    cfg = config([1, prefixes[0]])
    plain = config(None)
    plain.data.path = prefixes[0]
    blend, single = build_datasets(cfg), build_datasets(plain)
    for i in range(100):
        np.testing.assert_array_equal(blend.train[i].tokens, single.train[i].tokens)
    for i in range(10):
        np.testing.assert_array_equal(blend.valid[i].tokens, single.valid[i].tokens)


def test_the_written_forms_are_one_blend(prefixes):
    a, b = prefixes[:2]
    forms = [[0.3, a, 0.7, b], [3, a, 7, b], f"0.3 {a} 0.7 {b}",
             [{"weight": 0.3, "path": a}, {"weight": 0.7, "path": b}]]
    bundles = [build_datasets(config(f)) for f in forms]
    assert all(x.blend == [[0.3, a], [0.7, b]] for x in bundles)
    for i in range(20):
        for other in bundles[1:]:
            np.testing.assert_array_equal(bundles[0].train[i].tokens, other.train[i].tokens)


# ------------------------------------------------------------------------------ a function of (seed, step)


def test_step_k_directly_equals_step_k_after_iterating(prefixes):
    blend = [0.3, prefixes[0], 0.7, prefixes[1]]
    walked = build_datasets(config(blend)).train
    k, gbs = 100, 8  # 800 samples: several epochs of each component (about 100 samples per epoch)
    assert k * gbs * 0.3 > 2 * walked.components[0].samples_per_epoch
    for step in range(k):
        global_batch(walked, step, gbs)
    direct = build_datasets(config(blend)).train
    for x, y in zip(global_batch(walked, k, gbs), global_batch(direct, k, gbs), strict=True):
        np.testing.assert_array_equal(x.tokens, y.tokens)
    far = 10**9 + 3  # a step far out: same from a fresh bundle, no replay needed
    for x, y in zip(global_batch(walked, far, gbs), global_batch(build_datasets(config(blend)).train, far, gbs),
                    strict=True):
        np.testing.assert_array_equal(x.tokens, y.tokens)


def test_different_seeds_give_different_orders(prefixes):
    blend = [0.3, prefixes[0], 0.7, prefixes[1]]
    one, two = (build_datasets(config(blend, seed=s)).train for s in (1, 2))
    a = [one[i].tokens for i in range(40)]
    b = [two[i].tokens for i in range(40)]
    assert any(len(x) != len(y) or (x != y).any() for x, y in zip(a, b, strict=True))
    assert [one.locate(i)[0] for i in range(40)] == [two.locate(i)[0] for i in range(40)]  # the same mix


def test_validation_blend_uses_each_components_held_out_documents(prefixes):
    bundle = build_datasets(config([0.2, prefixes[0], 0.3, prefixes[1], 0.5, prefixes[2]], valid_fraction=0.2))
    valid = bundle.valid
    assert isinstance(valid, BlendedDataset) and valid.weights == bundle.train.weights
    for t, v in zip(bundle.train.components, valid.components, strict=True):
        assert not set(t.doc_ids) & set(v.doc_ids) and len(v.doc_ids) == 12
    assert [component_of(valid[i].tokens) for i in range(10)] == [valid.locate(i)[0] for i in range(10)]


def test_validation_blend_leaves_out_components_without_held_out_samples(prefixes, tmp_path, caplog):
    with IndexedDatasetWriter(str(tmp_path / "one"), 257, "byte", eod_id=256) as w:  # one document: nothing held out
        w.add_document(np.full(100, 2 * RANGE))
        w.finalize()
    bundle = build_datasets(config([0.3, prefixes[0], 0.7, str(tmp_path / "one")]))
    assert bundle.train.weights == [0.3, 0.7]
    assert bundle.valid.names == [prefixes[0]] and bundle.valid.weights == [1.0]
    assert "validation blend without" in caplog.text
    assert {component_of(bundle.valid[i].tokens) for i in range(10)} == {0}


def test_varlen_blend_answers_lengths_reads_and_token_budgets(prefixes):
    bundle = build_datasets(config([0.3, prefixes[0], 0.7, prefixes[1]], varlen=True))
    train = bundle.train
    assert all(isinstance(c, VarlenDataset) for c in train.components)
    for i in range(200):
        tokens = train[i].tokens
        assert train.sample_length(i) == len(tokens) == train[i].doc_lengths[0]
        np.testing.assert_array_equal(train.read(i, 1, len(tokens) - 1), tokens[1:])
    steps = TokenBudgetSteps(train, 100)
    for s in range(20):
        ids = steps.ids(s)
        inputs = [train.sample_length(k) - 1 for k in ids]
        assert len(ids) == 1 or sum(inputs) <= 100
        assert ids.stop == steps.start(s + 1)
    resumed = TokenBudgetSteps(train, 100, first_step=10, first_sample=steps.start(10))
    assert [resumed.ids(s) for s in range(10, 20)] == [steps.ids(s) for s in range(10, 20)]


# --------------------------------------------------------------------------------------- training


TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=2",
        "model.seq_length=32", "data=indexed", "data.valid_fraction=0.05", "trainer.global_batch_size=8",
        "trainer.micro_batch_size=4", "trainer.log_interval=1", "trainer.eval_interval=0", "trainer.save_interval=0",
        "logging.tensorboard=false", "optim.warmup_steps=2", "trainer.device=cpu"]


def blend_config(*overrides: str):
    return compose_config(*TINY, *overrides, tiny=False)


@pytest.mark.parametrize("mode", [[], ["data.varlen=true", "trainer.tokens_per_step=150"]],
                         ids=["packed", "varlen-token-budget"])
def test_resumed_blend_run_has_the_losses_of_an_uninterrupted_one(prefixes, tmp_path, mode):
    common = [f"data.blend=[0.3,{prefixes[0]},0.7,{prefixes[1]}]", "trainer.max_steps=6", "trainer.save_interval=3",
              "model.dropout=0.1", *mode]
    Trainer(blend_config(*common), tmp_path / "straight").fit()
    stopped = tmp_path / "stopped"
    assert Trainer(blend_config(*common, "trainer.stop_at_step=3"), stopped).fit().steps == 3
    resumed = Trainer(blend_config(*common), stopped)
    assert resumed.step == 3
    resumed.fit()
    expected = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "straight")}
    got = {r["step"]: r["loss"] for r in read_metrics(stopped)}
    assert sorted(got) == list(range(1, 7))
    assert [got[s] for s in range(4, 7)] == [expected[s] for s in range(4, 7)]


def test_a_blend_counts_its_samples_before_a_component_repeats(prefixes, tmp_path, caplog):
    """BlendedDataset.samples_per_epoch, brute-forced: the first blend index whose component sample is past that
    component's epoch. An evaluation of a blend read it from a missing attribute, a crash at the start of every blend
    run with eval_interval > 0 (2026-12-06, the evaluation-coverage line's first version)."""
    import logging
    from types import SimpleNamespace

    for sizes, quotas in (([5, 7], [3, 7]), ([1, 40], [1, 1]), ([9], [1]), ([4, 4, 30], [2, 5, 1])):
        blend = BlendedDataset([SimpleNamespace(samples_per_epoch=n, seq_length=8, num_docs=1, num_tokens=1)
                                for n in sizes], quotas, [str(n) for n in sizes])
        i = 0
        while (lambda d, j: j < sizes[d])(*blend.locate(i)):
            i += 1
        assert blend.samples_per_epoch == i, (sizes, quotas)
    with caplog.at_level(logging.WARNING, logger="megalm"):
        trainer = Trainer(blend_config(f"data.blend=[0.3,{prefixes[0]},0.7,{prefixes[1]}]", "trainer.max_steps=1",
                                       "trainer.eval_interval=1", "trainer.eval_iters=50"), tmp_path)
        assert trainer.fit().val_loss is not None
    held = trainer.data.valid.samples_per_epoch
    assert 0 < held < 400 and f"each evaluation reads 400 validation samples, and the split holds {held}" in caplog.text


def test_resume_with_another_blend_is_refused(prefixes, tmp_path):
    a, b = prefixes[:2]
    Trainer(blend_config(f"data.blend=[0.3,{a},0.7,{b}]", "trainer.max_steps=1"), tmp_path).fit()
    with pytest.raises(CheckpointError, match=r"blend=\[\[0.3, '.*a'\], \[0.7, '.*b'\]\], this run has "
                                              r"\[\[0.5, '.*a'\], \[0.5, '.*b'\]\]") as info:
        Trainer(blend_config(f"data.blend=[1,{a},1,{b}]", "trainer.max_steps=2"), tmp_path)
    assert "\n" not in str(info.value)
    with pytest.raises(CheckpointError, match="this run has None"):
        Trainer(blend_config(f"data.path={a}", "trainer.max_steps=2"), tmp_path)
    # the same mix, written differently, resumes
    assert Trainer(blend_config(f"data.blend=[3,{a},7,{b}]", "trainer.max_steps=2"), tmp_path).step == 1


def test_resume_with_another_data_path_is_refused(prefixes, tmp_path):
    """data.path is the data source as a one-component blend is: another one changes every later sample (it resumed
    without a word; the guide lists the data source among what a resume must match)."""
    a, b = prefixes[:2]
    Trainer(blend_config(f"data.path={a}", "trainer.max_steps=1"), tmp_path).fit()
    with pytest.raises(CheckpointError, match=rf"trained with path={a}, this run has {b}; resuming would change"):
        Trainer(blend_config(f"data.path={b}", "trainer.max_steps=2"), tmp_path)
    assert Trainer(blend_config(f"data.path={a}", "trainer.max_steps=2"), tmp_path).step == 1


# --------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("overrides, message", [
    (["data.blend=[0.3,A,0.7]"], "has 3 entries, an odd number"),
    (["data.blend=[A,0.3,B,0.7]"], "weight 'A' .entry 0. is not a number"),
    (["data.blend='0.3 A x B'"], "weight 'x' .entry 2. is not a number"),
    (["data.blend=[0,A,1,B]"], "weight 0 of A must be > 0"),
    (["data.blend=[-1,A,1,B]"], "weight -1 of A must be > 0"),
    (["data.blend=[0.5,A,0.5,A]"], "lists A twice"),
    # one dataset spelled two ways sampled it twice as two components, with the same seed (an audit, 2026-12-06)
    (["data.blend=[0.5,d/A,0.5,d/./A]"], r"lists one dataset twice, as d/A and d/./A; give it one entry"),
    (["data.blend=[{weight:1,prefix:A}]"], "needs exactly weight and path"),
    (["data.blend=[]"], "is not a weighted list"),
    (["data.blend=[1,A]", "data.path=B"], "data.path=B and data.blend are both set"),
    (["data=synthetic", "data.blend=[1,A]"], "but data=synthetic; add data=indexed"),
    (["data=demo", "data.path=corpus"], "data.path=corpus is read by data=indexed only, but data=demo; add data=i"),
])
def test_bad_blend_config_is_a_one_line_config_error(overrides, message):
    base = [] if any(o.startswith("data=") for o in overrides) else ["data=indexed"]
    with pytest.raises(ConfigError, match=message) as info:
        validate(compose_config(*base, *overrides, tiny=False))
    assert "\n" not in str(info.value)


def test_bad_blend_data_is_a_one_line_data_error(prefixes, tmp_path):
    a = prefixes[0]
    text = tmp_path / "docs.jsonl"
    text.write_text('{"text": "x"}\n')
    cases = [
        ([1, a, 1, str(tmp_path / "missing")], r"^the data.blend entry .*missing: .*missing.idx not found"),
        # an entry naming its .bin, or a text file: the hint data.path gets, for this entry (it said to preprocess
        # again with that name as the prefix, an audit 2026-12-06)
        ([1, a, 1, f"{a}.bin"], rf"^the data.blend entry {a}.bin names a file; .* write the data.blend entry {a}$"),
        ([1, a, 1, str(text)], rf"tokenize it with megalm-preprocess --input {text} .* the data.blend entry "
                               rf"{tmp_path / 'docs'}$"),
        ([1, a, 1, write_component(tmp_path / "vocab", 1, vocab_size=300)], "mixes tokenizations: .* vocab 300"),
        ([1, a, 1, write_component(tmp_path / "eod", 1, eod_id=0)], "mixes tokenizations: .* eod 0"),
        ([1, a, 1, write_component(tmp_path / "spec", 1, spec="")], "mixes tokenizations: .*tokenizer ''"),
    ]
    tiny = str(tmp_path / "tiny")  # too few tokens for one sample: which component is named
    with IndexedDatasetWriter(tiny, 257, "byte", eod_id=256) as w:
        for _ in range(2):
            w.add_document(np.array([RANGE, RANGE + 1, RANGE + 2]))
        w.finalize()
    cases.append(([1, a, 1, tiny], rf"data.blend component {tiny}: \d+ documents? hold .* tokens, fewer than"))
    for blend, message in cases:
        with pytest.raises(DataError, match=message) as info:
            build_datasets(config(blend))
        assert "\n" not in str(info.value)
    with pytest.raises(DataError, match="missing.idx not found"):  # through the trainer too, before any weight
        Trainer(blend_config(f"data.blend=[1,{a},1,{tmp_path / 'missing'}]"), tmp_path / "run")


def test_components_of_one_tokenizer_at_two_paths_blend(tmp_path):
    """The tokenizer was compared by its path: the same tokenizer.json copied (datasets preprocessed on two
    machines) or linked was refused as another tokenization, and no data.tokenizer could say otherwise. It is
    compared by content now; two tokenizers of one vocab size and eod are still two, unless data.tokenizer names
    the one they stand for."""
    import shutil

    from tests.unit.test_data import make_hf_tokenizer

    first = make_hf_tokenizer(tmp_path / "machine_a.json", [f"w{i}" for i in range(255)])  # vocab 257, eod 256
    copy = tmp_path / "machine_b" / "tokenizer.json"
    copy.parent.mkdir()
    shutil.copy(first, copy)
    other = make_hf_tokenizer(tmp_path / "other.json", [f"v{i}" for i in range(255)])  # the same sizes
    a = write_component(tmp_path / "a", 0, spec=str(first))
    b = write_component(tmp_path / "b", 1, spec=str(copy.parent))
    c = write_component(tmp_path / "c", 1, spec=str(other))
    bundle = build_datasets(config([1, a, 1, b]))
    assert bundle.tokenizer.vocab_size == 257
    with pytest.raises(DataError, match="mixes tokenizations: .*other.json"):
        build_datasets(config([1, a, 1, c]))
    named = config([1, a, 1, c])
    named.data.tokenizer = str(first)
    assert build_datasets(named).tokenizer.spec == str(first)
