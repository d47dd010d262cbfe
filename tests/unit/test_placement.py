import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pswire.placement import MIN_SPLIT_BYTES, VariableSpec, model_spec, place

pytestmark = pytest.mark.timeout(120)

shapes = st.lists(
    st.tuples(st.integers(1, 3000), st.integers(1, 300)).map(tuple) | st.just(()),
    min_size=1, max_size=12,
)


def _spec(shape_list):
    return [VariableSpec(f"v{i}", s, torch.float32) for i, s in enumerate(shape_list)]


@settings(max_examples=200, deadline=None)
@given(shapes, st.integers(1, 6))
def test_every_row_of_every_variable_is_placed_exactly_once(shape_list, num_shards):
    spec = _spec(shape_list)
    placement = place(spec, num_shards)
    for var in spec:
        pieces = placement.parts_of(var.name)
        rows = var.shape[0] if var.shape else 1
        assert pieces[0][1].row_start == 0 and pieces[-1][1].row_end == rows
        for (_, a), (_, b) in zip(pieces, pieces[1:]):
            assert a.row_end == b.row_start
        # A split variable has its pieces on distinct shards.
        assert len({shard for shard, _ in pieces}) == len(pieces)


@settings(max_examples=200, deadline=None)
@given(shapes, st.integers(1, 6))
def test_placement_is_deterministic_and_order_independent_of_calls(shape_list, num_shards):
    spec = _spec(shape_list)
    first, second = place(spec, num_shards), place(list(spec), num_shards)
    assert first == second and first.digest() == second.digest()


@settings(max_examples=200, deadline=None)
@given(shapes, st.integers(2, 6))
def test_no_shard_holds_much_more_than_its_share(shape_list, num_shards):
    spec = _spec(shape_list)
    loads = place(spec, num_shards).shard_bytes()
    total = sum(v.nbytes for v in spec)
    threshold = max(MIN_SPLIT_BYTES, total // (8 * num_shards))
    # Greedy largest-first bound: the share plus one unsplit variable (<= threshold) plus
    # rounding of row ranges (one row of the widest variable).
    widest_row = max(v.nbytes // (v.shape[0] if v.shape else 1) for v in spec)
    assert max(loads) <= total / num_shards + threshold + widest_row


def test_one_large_tensor_is_split_evenly_by_rows():
    placement = place([VariableSpec("emb", (1000, 256), torch.float32)], 4)
    assert placement.shard_bytes() == [250 * 256 * 4] * 4
    assert [p.key for p in placement.shards[1]] == ["emb[250:500]"]


def test_digest_changes_with_shape_and_shard_count():
    spec = _spec([(10, 10), (5,)])
    other = _spec([(10, 11), (5,)])
    assert place(spec, 2).digest() != place(other, 2).digest()
    assert place(spec, 2).digest() != place(spec, 3).digest()


def test_model_spec_and_errors():
    model = torch.nn.Linear(3, 2)
    spec = model_spec(model.named_parameters())
    assert [(v.name, v.shape) for v in spec] == [("weight", (2, 3)), ("bias", (2,))]
    with pytest.raises(ValueError, match="duplicate"):
        model_spec([("a", torch.zeros(1)), ("a", torch.zeros(1))])
    with pytest.raises(ValueError, match="shards must be >= 1"):
        place(spec, 0)
    with pytest.raises(ValueError, match="no variables"):
        place([], 2)
