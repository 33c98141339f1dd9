"""The one quantile: numpy's default method, whatever the order or the size of the values."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.quantiles import quantile, quantiles


def test_a_hand_worked_quantile() -> None:
    # 11 values: the p99 sits 0.9 of the way from the 10th (9.0) to the 11th (100.0).
    values = [100.0, *range(10)]
    assert quantile(values, 0.5) == 5.0
    assert quantile(values, 0.99) == pytest.approx(9.0 + 0.9 * 91.0)
    assert quantiles(values, (0.0, 1.0)) == [0.0, 100.0]


def test_no_values_read_zero() -> None:
    assert quantile([], 0.99) == 0.0
    assert quantiles([], (0.5, 0.99)) == [0.0, 0.0]


@given(
    st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=300),
    st.floats(0.0, 1.0),
)
def test_it_is_numpys_default_method(values: list[float], q: float) -> None:
    assert np.isclose(quantile(values, q), np.percentile(values, 100 * q), rtol=1e-9, atol=1e-6)
