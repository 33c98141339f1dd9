"""The exhaustive placement oracle: count-vector search equals one-by-one enumeration."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lab.eval.placement_oracle import (
    PlacementInstance,
    brute_force,
    objective,
    optimum,
    random_instance,
)

CHUNK = (100.0, 120.0, 150.0, 190.0)  # batch 1..4, K = 4


def test_a_hand_made_instance():
    # GPU 0 holds three sessions, GPU 1 none; moving one (kappa 10) halves nothing but the
    # worst latency falls from 150 to 120: J = 120 + 0.5 * 10.
    inst = PlacementInstance(
        latency=((0.0, *CHUNK), (0.0, *CHUNK)),
        current=(0, 0, 0),
        kappa=(30.0, 10.0, 20.0),
        eta=0.5,
    )
    j, assignment = optimum(inst)
    assert j == pytest.approx(125.0)
    assert objective(inst, assignment) == pytest.approx(j)
    assert assignment.count(1) == 1 and assignment[1] == 1


def test_a_dear_migration_is_not_worth_it():
    inst = PlacementInstance(
        latency=((0.0, *CHUNK), (0.0, *CHUNK)), current=(0, 0, 0), kappa=(500.0,) * 3, eta=1.0
    )
    assert optimum(inst) == (150.0, (0, 0, 0))


def test_over_capacity_is_infeasible():
    inst = PlacementInstance(latency=((0.0, 1.0),), current=(None, None), kappa=(0, 0), eta=0)
    assert optimum(inst)[0] == float("inf")


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000))
def test_count_vector_search_equals_brute_force(seed):
    rng = random.Random(seed)
    inst = random_instance(
        rng, CHUNK, (5.0, 60.0), rng.choice([0.0, 0.1, 1.0, 3.0]), max_gpus=3, max_sessions=7
    )
    j_fast, assignment = optimum(inst)
    j_slow, _ = brute_force(inst)
    assert j_fast == pytest.approx(j_slow)
    assert objective(inst, assignment) == pytest.approx(j_fast)


def test_random_instances_respect_capacity():
    rng = random.Random(7)
    for _ in range(50):
        inst = random_instance(rng, CHUNK, (5.0, 60.0), 0.1)
        placed = [g for g in inst.current if g is not None]
        assert all(placed.count(g) <= inst.capacity for g in set(placed))
        assert optimum(inst)[0] < float("inf")


def test_the_core_never_beats_the_oracle():
    from lab.eval.placement_gap import core_objective, placement_gap
    from shared.profile import load_profile

    profile = load_profile()
    chunk = tuple(profile.chunk_ms(b) for b in range(1, profile.capacity + 1))
    rng = random.Random(3)
    for _ in range(150):
        inst = random_instance(rng, chunk, (10.0, 40.0), rng.choice([0.1, 1.0]))
        j_core, _ = core_objective(inst, profile)
        assert j_core >= optimum(inst)[0] - 1e-9
    gap = placement_gap(profile, instances=100, capacity=4)
    assert gap.instances == 100 and 0.0 <= gap.avg_pct <= gap.max_pct
