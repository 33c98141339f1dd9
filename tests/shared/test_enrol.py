"""The seal of an enrolment's reply (shared/enrol.py): only the key it was sealed to opens it,
and only for the id it was sealed for."""

from __future__ import annotations

import pytest

from shared.enrol import EnrolError, EnrolKey, check_public_key, seal


def test_a_sealed_password_opens_with_its_key_for_its_id_only():
    mine, other = EnrolKey(), EnrolKey()
    sealed = seal(mine.public, "s3cret", "w1")
    assert "s3cret" not in sealed
    assert mine.open(sealed, "w1") == "s3cret"
    with pytest.raises(EnrolError, match="not sealed to this key"):
        other.open(sealed, "w1")  # another enrol holder reads the reply, and learns nothing
    with pytest.raises(EnrolError, match="not sealed to this key"):
        mine.open(sealed, "w2")  # nor passes it off as another id's
    assert seal(mine.public, "s3cret", "w1") != sealed  # a fresh ephemeral key each time


@pytest.mark.parametrize("text", ["", "!!", "bm90IGEga2V5", "A" * 44])
def test_a_key_that_is_not_one_is_refused(text):
    with pytest.raises(EnrolError):
        check_public_key(text)


def test_a_tampered_seal_is_refused():
    key = EnrolKey()
    sealed = seal(key.public, "s3cret", "w1")
    flipped = sealed[:-4] + ("AAAA" if not sealed.endswith("AAAA") else "BBBB")
    with pytest.raises(EnrolError):
        key.open(flipped, "w1")
    with pytest.raises(EnrolError, match="too short"):
        key.open("AAAA", "w1")
    assert "s3cret" not in repr(key)
