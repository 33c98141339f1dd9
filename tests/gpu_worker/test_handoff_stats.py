"""The measured handoff cost a worker puts in its heartbeat."""

from __future__ import annotations

import pytest

from services.gpu_worker.handoff.stats import MIB, HandoffSample, HandoffStats


def sample(mib: float, offer: float, transfer: float, commit: float, connect: float = 0.0):
    return HandoffSample(
        nbytes=int(mib * MIB),
        offer_ms=offer,
        transfer_ms=transfer,
        commit_ms=commit,
        connect_ms=connect,
    )


def test_no_samples_no_figures():
    cost = HandoffStats().cost()
    assert cost.fixed_ms is None and cost.ms_per_mib is None and cost.first_use_ms is None
    assert cost.samples == 0


def test_fixed_and_per_mib_are_medians_of_the_decomposition():
    stats = HandoffStats()
    stats.add(sample(64, offer=1.0, transfer=32.0, commit=2.0, connect=40.0))  # first use
    stats.add(sample(64, offer=1.5, transfer=16.0, commit=1.5))
    stats.add(sample(64, offer=9.0, transfer=64.0, commit=1.0))  # an outlier
    cost = stats.cost()
    assert cost.fixed_ms == pytest.approx(3.0)  # medians of 3.0, 3.0, 10.0
    assert cost.ms_per_mib == pytest.approx(0.5)  # medians of 0.5, 0.25, 1.0
    assert cost.first_use_ms == pytest.approx(40.0)  # only handoffs that built a link
    assert cost.samples == 3


def test_cost_predicts_a_handoff_of_the_size_seen():
    stats = HandoffStats()
    for _ in range(5):
        stats.add(sample(256, offer=2.0, transfer=100.0, commit=1.0))
    cost = stats.cost()
    assert cost.fixed_ms + cost.ms_per_mib * 256 == pytest.approx(103.0)


def test_only_recent_samples_count():
    stats = HandoffStats(keep=2)
    stats.add(sample(1, offer=100.0, transfer=100.0, commit=100.0))
    stats.add(sample(1, offer=1.0, transfer=1.0, commit=1.0))
    stats.add(sample(1, offer=1.0, transfer=1.0, commit=1.0))
    assert stats.cost().fixed_ms == pytest.approx(2.0)
    assert stats.cost().samples == 2


def test_an_empty_state_has_no_per_byte_figure():
    stats = HandoffStats()
    stats.add(sample(0, offer=1.0, transfer=0.1, commit=1.0))
    assert stats.cost().ms_per_mib is None and stats.cost().fixed_ms == pytest.approx(2.0)


def test_bad_samples_and_settings_are_refused():
    with pytest.raises(ValueError, match="cannot be negative"):
        HandoffStats().add(sample(1, offer=-1.0, transfer=1.0, commit=1.0))
    with pytest.raises(ValueError, match="keep must be >= 1"):
        HandoffStats(keep=0)
