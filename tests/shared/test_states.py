import pytest

from shared.states import (
    TERMINAL,
    TRANSITIONS,
    IllegalTransition,
    SessionState,
    can_transition,
    check_transition,
    sources_of,
)

S = SessionState


def test_every_state_has_a_row():
    assert set(TRANSITIONS) == set(SessionState)


def test_terminated_is_the_only_terminal_state():
    assert TERMINAL == {S.TERMINATED}


@pytest.mark.parametrize(
    ("current", "target"),
    [
        (S.PENDING, S.EXECUTING),
        (S.EXECUTING, S.SUSPENDED),
        (S.SUSPENDED, S.EXECUTING),
        (S.EXECUTING, S.MIGRATING),
        (S.MIGRATING, S.EXECUTING),
        (S.EXECUTING, S.PENDING),  # worker died: re-place
        (S.PENDING, S.TERMINATED),
        (S.SUSPENDED, S.TERMINATED),
    ],
)
def test_lifecycle_edges_allowed(current, target):
    assert can_transition(current, target)
    check_transition(current, target)


@pytest.mark.parametrize(
    ("current", "target"),
    [
        (S.TERMINATED, S.PENDING),
        (S.TERMINATED, S.EXECUTING),
        (S.PENDING, S.SUSPENDED),  # nothing to suspend before it ever ran
        (S.PENDING, S.MIGRATING),
        (S.EXECUTING, S.EXECUTING),
    ],
)
def test_illegal_edges_raise_with_facts(current, target):
    assert not can_transition(current, target)
    with pytest.raises(IllegalTransition) as info:
        check_transition(current, target)
    assert info.value.current is current and info.value.target is target
    assert str(current) in str(info.value) and str(target) in str(info.value)


def test_every_state_can_reach_terminated():
    for state in SessionState:
        if state is not S.TERMINATED:
            assert can_transition(state, S.TERMINATED)


def test_sources_of_inverts_the_table():
    for target in SessionState:
        for source in SessionState:
            assert (source in sources_of(target)) == (target in TRANSITIONS[source])
