"""Layer split over pipeline stages: even, explicit, interleaved (vpp), errors, embedding/head owners."""

import ast
import re

import pytest

from megalm.errors import ConfigError
from megalm.parallel.pipeline.stages import StageSplitError, split_layers, stage_holds, stage_layer_ranges


def as_lists(ranges: list[list[range]]) -> list[list[list[int]]]:
    return [[list(r) for r in chunks] for chunks in ranges]


def test_even_split_no_vpp():
    assert as_lists(stage_layer_ranges(8, pp=4)) == [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]]
    assert as_lists(stage_layer_ranges(3, pp=1)) == [[[0, 1, 2]]]


def test_vpp_interleaving():
    assert as_lists(stage_layer_ranges(8, pp=2, vpp=2)) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    # 12 layers, pp=2, vpp=3: virtual stage v = c*pp + r holds layers [2v, 2v+1]
    ranges = stage_layer_ranges(12, pp=2, vpp=3)
    assert as_lists(ranges) == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [10, 11]]]


def test_explicit_uneven_split():
    ranges = stage_layer_ranges(10, pp=4, layers_per_stage=[2, 3, 3, 2])
    assert ranges == [[range(0, 2)], [range(2, 5)], [range(5, 8)], [range(8, 10)]]
    # with vpp: counts are in virtual-stage order, then dealt out to ranks
    ranges = stage_layer_ranges(7, pp=2, vpp=2, layers_per_stage=[1, 2, 3, 1])
    assert ranges == [[range(0, 1), range(3, 6)], [range(1, 3), range(6, 7)]]


def test_first_and_last_stage_may_be_empty():
    ranges = stage_layer_ranges(4, pp=3, layers_per_stage=[0, 4, 0])
    assert ranges == [[range(0, 0)], [range(0, 4)], [range(4, 4)]]


def test_every_layer_is_held_exactly_once():
    for num_layers, pp, vpp in [(8, 2, 2), (12, 3, 2), (16, 4, 2), (6, 1, 3)]:
        layers = [i for chunks in stage_layer_ranges(num_layers, pp, vpp) for r in chunks for i in r]
        assert sorted(layers) == list(range(num_layers))


@pytest.mark.parametrize("args, kwargs, message", [
    ((10, 2, 2), {}, "num_layers=10 is not divisible into pp*vpp=4 stages; set 'parallel.layers_per_stage=[2,3,3,2]'"),
    ((1, 4), {}, "num_layers=1 is not divisible into pp*vpp=4 stages; use fewer stages"),
    ((0, 1), {}, "model.num_layers=0 must be >= 1"),
    ((8, 0), {}, "parallel.pp=0 must be >= 1"),
    ((8, 2, 0), {}, "parallel.vpp=0 must be >= 1"),
    ((8, 2), {"layers_per_stage": [4, 4, 0]}, "has 3 entries but pp*vpp=2"),
    ((8, 2), {"layers_per_stage": [4, 3]}, "sums to 7, not model.num_layers=8"),
    ((8, 3), {"layers_per_stage": [4, 0, 4]}, "layers_per_stage[1]=0 must be >= 1"),
    ((8, 3), {"layers_per_stage": [-1, 5, 4]}, "layers_per_stage[0]=-1 must be >= 0"),
    ((8, 2), {"layers_per_stage": [4.0, 4]}, "must be a list of integers"),
])
def test_bad_splits_raise_with_the_fix(args, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        stage_layer_ranges(*args, **kwargs)
    assert isinstance(info.value, ConfigError)  # the CLI prints it as one line


def test_suggested_split_is_itself_valid():
    for num_layers, stages in [(10, 4), (2, 4), (7, 2), (13, 5), (5, 3)]:
        with pytest.raises(StageSplitError) as info:
            split_layers(num_layers, stages)
        hint = ast.literal_eval(re.search(r"layers_per_stage=(\[.*\])", str(info.value)).group(1))
        assert split_layers(num_layers, stages, hint) == hint


def test_stage_holds_embedding_first_head_last():
    pp, vpp = 4, 1
    assert [stage_holds(r, 0, pp, vpp) for r in range(pp)] == [(True, False), (False, False), (False, False),
                                                             (False, True)]
    pp, vpp = 2, 3  # first virtual stage: rank 0 chunk 0; last: rank 1 chunk 2
    holds = {(r, c): stage_holds(r, c, pp, vpp) for r in range(pp) for c in range(vpp)}
    assert [k for k, (emb, _) in holds.items() if emb] == [(0, 0)]
    assert [k for k, (_, head) in holds.items() if head] == [(1, 2)]
    assert stage_holds(0, 0, 1, 1) == (True, True)  # no pipeline: one stage holds both
    with pytest.raises(ValueError, match="outside pp=2, vpp=3"):
        stage_holds(2, 0, 2, 3)
    with pytest.raises(ValueError, match="outside pp=2, vpp=3"):
        stage_holds(0, 3, 2, 3)


def test_an_empty_layers_per_stage_is_refused_not_read_as_unset(make_config):
    """`parallel.layers_per_stage=[]` is a split of no stages (it had been taken for null: the even split)."""
    from megalm.training.validation import validate_run

    with pytest.raises(ConfigError, match=re.escape("has 0 entries but pp*vpp=2")):
        validate_run(make_config("parallel.pp=2", "model.num_layers=4", "parallel.layers_per_stage=[]"), world_size=2)
