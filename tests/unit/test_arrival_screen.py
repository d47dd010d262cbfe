"""Unit tier: a bulk push's bytes read for NaN while they arrive (``psserver.screen.ArrivalScreen``)
and the bounds ``gradient_bounds`` takes from it."""

from __future__ import annotations

import numpy as np
import pytest

from psserver.screen import ArrivalScreen, NonFiniteError, gradient_bounds
from pswire.codec import Part
from pswire.dtypes import FLOAT32

pytestmark = pytest.mark.timeout(120)

PIECE = 4096  # bytes; the lanes read 4 MiB pieces, the arithmetic is the same


def _screened(buffer: np.ndarray, piece: int = PIECE) -> float | None:
    screen = ArrivalScreen(buffer)
    for start in range(0, buffer.size, piece):
        screen.add(start, min(start + piece, buffer.size))
    return screen.bound()


@pytest.mark.parametrize("seed", range(5))
def test_the_bound_is_the_largest_magnitude_of_every_float32_word(seed):
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal(10_000) * 10.0 ** rng.integers(-30, 30, 10_000)).astype(np.float32)
    buffer = np.frombuffer(values.tobytes(), np.uint8).copy()
    assert _screened(buffer, piece=4 * int(rng.integers(1, 3000))) == float(np.abs(values).max())


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [0, 1023, 1024, 9_999])  # first word, a piece's edges, the last word
def test_a_word_that_is_not_finite_gives_no_bound(bad, where):
    values = np.ones(10_000, np.float32)
    values[where] = bad
    assert _screened(np.frombuffer(values.tobytes(), np.uint8).copy()) is None


def test_bytes_of_other_dtypes_that_read_as_nan_give_no_bound():
    # An integer whose bits are a float32 NaN's: then the gradients are read one by one.
    other = np.array([5, 0x7FC00000], np.int32)
    buffer = np.frombuffer(np.ones(1000, np.float32).tobytes() + other.tobytes(), np.uint8).copy()
    assert _screened(buffer) is None


def test_a_partial_last_word_is_left_out():
    values = np.full(1000, -3.0, np.float32)
    buffer = np.frombuffer(values.tobytes() + b"\xff\xff\xff", np.uint8).copy()  # 3 bytes: a NaN if read
    assert _screened(buffer) == 3.0


def test_nothing_added_gives_no_bound():
    assert ArrivalScreen(np.zeros(64, np.uint8)).bound() is None


def test_a_piece_must_start_on_a_word():
    with pytest.raises(AssertionError):
        ArrivalScreen(np.zeros(64, np.uint8)).add(2, 10)


def test_screened_gradients_are_not_read_again_and_the_rest_are():
    parts = [Part("a", (4,), FLOAT32, 0, 4), Part("b", (4,), FLOAT32, 0, 4)]
    nan = np.array([1.0, np.nan, 0.0, 0.0], np.float32)
    fine = np.array([1.0, -5.0, 0.0, 2.0], np.float32)
    # A screened bound stands for the gradient's own read (the shard read those bytes already).
    assert gradient_bounds(parts, [nan, fine], [7.0, None]) == [7.0, 5.0]
    with pytest.raises(NonFiniteError, match="'b'"):
        gradient_bounds(parts, [fine, nan], [7.0, None])
    with pytest.raises(ValueError, match="screened"):
        gradient_bounds(parts, [fine, fine], [7.0])
