"""Pure parts of the handoff: tensor specs and their checks, verification, checksum, receive
buffers, the offer <-> snapshot mapping, IPC handle encoding, addresses, the synthetic host."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.gpu_worker.handoff import tensors as tensors_module
from services.gpu_worker.handoff.codes import HandoffCode
from services.gpu_worker.handoff.host import HostRefused
from services.gpu_worker.handoff.rendezvous import parse_address
from services.gpu_worker.handoff.tensors import (
    BadSpec,
    VerificationFailed,
    buffers,
    check_specs,
    checksum,
    digest_context,
    frozen_from,
    new_secret,
    skeleton,
    spec_nbytes,
    spec_of,
    verify,
    verify_checksum,
)
from services.gpu_worker.handoff.transports import decode_ipc, encode_ipc
from shared.wire import HandoffOffer, TensorSpec
from tools.handoff.synthetic import (
    MISC_NUMEL,
    Layout,
    SyntheticHost,
    expected_state,
    initial_state,
)


def state() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [
        torch.randn(3, 5, generator=gen).to(torch.bfloat16),
        torch.randn(7, generator=gen),
        torch.empty(0),
    ]


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def test_specs_describe_shape_and_dtype_and_add_up():
    tensors = state()
    specs = [spec_of(t) for t in tensors]
    assert specs[0] == TensorSpec(shape=[3, 5], dtype="bfloat16")
    assert [spec_nbytes(s) for s in specs] == [30, 28, 0]
    check_specs(specs, nbytes(tensors))


@pytest.mark.parametrize(
    ("specs", "total", "fault"),
    [
        ([], 0, "0 tensors"),
        ([TensorSpec([4], "float32")], 15, "add up to 16 bytes, the offer says 15"),
        ([TensorSpec([4], "floaty")], 16, "unknown dtype 'floaty'"),
        ([TensorSpec([4], "Tensor")], 16, "unknown dtype 'Tensor'"),
        ([TensorSpec([4], "__class__")], 16, "unknown dtype"),
        ([TensorSpec([-4], "float32")], -16, "negative dimension"),
        ([TensorSpec([1], "uint8")] * 1025, 1025, "1025 tensors"),
    ],
)
def test_bad_specs_are_named(specs, total, fault):
    with pytest.raises(BadSpec, match=fault):
        check_specs(specs, total)


CONTEXT = digest_context("t1", "s1", 3, "wa", "wb")


def test_verify_accepts_what_was_offered_and_names_each_difference():
    tensors = state()
    specs = [spec_of(t) for t in tensors]
    total = nbytes(tensors)
    verify(tensors, specs, total)
    with pytest.raises(VerificationFailed, match="2 tensors received, 3 offered"):
        verify(tensors[:2], specs, total)
    with pytest.raises(VerificationFailed, match="tensor 1 is float64"):
        verify([tensors[0], tensors[1].double(), tensors[2]], specs, total)
    with pytest.raises(VerificationFailed, match="58 bytes received, 59 offered"):
        verify(tensors, specs, total + 1)


def _offer(tensors, secret, digest) -> HandoffOffer:
    return HandoffOffer(
        transfer_id="t1",
        session_id="s1",
        epoch=3,
        src="wa",
        dst="wb",
        transport="auto",
        tensors=[spec_of(t) for t in tensors],
        nbytes=nbytes(tensors),
        checksum=digest,
        secret=secret,
    )


def test_the_checksum_holds_only_under_the_offers_secret_and_for_its_bytes():
    tensors = state()
    secret = new_secret()
    digest = checksum(tensors, secret, CONTEXT)
    verify_checksum(tensors, _offer(tensors, secret, digest))
    flipped = [t.clone() for t in tensors]
    flipped[1][3] += 1
    with pytest.raises(VerificationFailed, match="checksum"):  # tampered bytes
        verify_checksum(flipped, _offer(tensors, secret, digest))
    with pytest.raises(VerificationFailed, match="secret"):  # a secret it was not made with
        verify_checksum(tensors, _offer(tensors, new_secret(), digest))
    with pytest.raises(ValueError, match="32 bytes"):
        checksum(tensors, "ab" * 16, CONTEXT)
    assert new_secret() != new_secret() and len(bytes.fromhex(new_secret())) == 32


def test_the_checksum_sees_every_bit_the_layout_and_the_transfer():
    tensors, secret = state(), new_secret()
    reference = checksum(tensors, secret, CONTEXT)
    assert checksum([t.clone() for t in tensors], secret, CONTEXT) == reference
    one_bit = [t.clone() for t in tensors]
    one_bit[0].view(torch.int16)[2, 4] ^= 1
    assert checksum(one_bit, secret, CONTEXT) != reference
    # The same bytes in another shape, dtype or order are another state.
    assert checksum([tensors[0].reshape(5, 3), *tensors[1:]], secret, CONTEXT) != reference
    as_int = [tensors[0].view(torch.int16), *tensors[1:]]
    assert checksum(as_int, secret, CONTEXT) != reference
    assert checksum([tensors[1], tensors[0], tensors[2]], secret, CONTEXT) != reference
    # State checksummed for one transfer fits no other (another epoch, another destination).
    assert checksum(tensors, secret, digest_context("t1", "s1", 4, "wa", "wb")) != reference
    assert checksum(tensors, secret, digest_context("t1", "s1", 3, "wa", "wc")) != reference
    # Non-contiguous tensors are hashed by value.
    non_contiguous = [tensors[0].t().contiguous().t(), *tensors[1:]]
    assert checksum(non_contiguous, secret, CONTEXT) == reference


def test_a_state_of_many_blocks_is_hashed_in_parallel_as_it_would_be_in_order(monkeypatch):
    """Leaves are 8 MiB: a 20 MiB tensor has three, hashed in threads; one bit in the last
    block changes the checksum, and the result is the same one thread makes."""
    big = [torch.randint(0, 255, (20 << 20,), dtype=torch.uint8), torch.ones(3)]
    secret = new_secret()
    reference = checksum(big, secret, CONTEXT)
    monkeypatch.setattr(tensors_module, "_HASH_THREADS", 1)
    assert checksum(big, secret, CONTEXT) == reference
    big[0][-1] ^= 1
    assert checksum(big, secret, CONTEXT) != reference


def test_receive_buffers_are_used_only_when_they_fit():
    specs = [TensorSpec([2, 3], "float32"), TensorSpec([4], "bfloat16")]
    cpu = torch.device("cpu")
    fitting = [torch.empty(2, 3), torch.empty(4, dtype=torch.bfloat16)]
    assert buffers(specs, cpu, fitting) is fitting
    for wrong in (
        [torch.empty(3, 2), fitting[1]],  # shape
        [fitting[0], torch.empty(4)],  # dtype
        [torch.empty(3, 2).t(), fitting[1]],  # not contiguous
        fitting[:1],
    ):  # count
        got = buffers(specs, cpu, wrong)
        assert got is not wrong and [spec_of(t) for t in got] == specs
    assert [spec_of(t) for t in buffers(specs, cpu, None)] == specs


def offer_for(tensors, **fields) -> HandoffOffer:
    base = dict(
        transfer_id="t1",
        session_id="s1",
        epoch=4,
        src="wa",
        dst="wb",
        transport="auto",
        tensors=[spec_of(t) for t in tensors],
        nbytes=nbytes(tensors),
        next_seq=9,
        engine_seq=9,
        position=27,
        prompt="a fox",
        pending_prompt="a wolf",
        seed=5,
        preset="tiny",
        dtype="float32",
        meta={"weights_seed": "0"},
        due_at=123.5,
        suspended=True,
    )
    base.update(fields)
    return HandoffOffer(**base)


def test_offer_maps_back_to_the_session_and_its_skeleton_has_no_bytes():
    tensors = [torch.ones(4), torch.ones(4), torch.zeros(2)]
    offer = offer_for(tensors)
    frozen = frozen_from(offer, tensors)
    snap = frozen.snapshot
    assert (frozen.next_seq, frozen.due_at, frozen.suspended) == (9, 123.5, True)
    assert (snap.seq, snap.position, snap.prompt, snap.pending_prompt, snap.seed) == (
        9,
        27,
        "a fox",
        "a wolf",
        5,
    )
    assert snap.layers == tensors[:2] and snap.misc is tensors[2]
    assert snap.meta == {"weights_seed": "0"} and snap.meta is not offer.meta
    bare = skeleton(offer)
    assert all(t.device.type == "meta" for t in [*bare.snapshot.layers, bare.snapshot.misc])
    assert [spec_of(t) for t in [*bare.snapshot.layers, bare.snapshot.misc]] == offer.tensors


def test_ipc_handles_travel_as_json_not_pickle():
    share = (
        torch.Tensor,
        torch.Size([2, 3]),
        (3, 1),
        0,
        object,
        torch.bfloat16,
        0,
        b"\x00handle\xff",
        4096,
        512,
        False,
        b"refcounter",
        8,
        b"\x01event",
        True,
    )
    payload = encode_ipc([share])
    assert payload.startswith(b"[{")
    (entry,) = decode_ipc(payload)
    assert entry["size"] == torch.Size([2, 3]) and entry["stride"] == (3, 1)
    assert entry["offset"] == 0 and entry["dtype"] is torch.bfloat16
    assert entry["share"] == [
        b"\x00handle\xff",
        4096,
        512,
        False,
        b"refcounter",
        8,
        b"\x01event",
        True,
    ]
    with pytest.raises(ValueError, match="cannot encode"):
        encode_ipc([(*share[:7], object(), *share[8:])])
    with pytest.raises(ValueError):
        decode_ipc(b'{"not": "a list"}')


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:4000", ("127.0.0.1", 4000)),
        ("[::1]:65535", ("::1", 65535)),
        ("worker-3.internal:29500", ("worker-3.internal", 29500)),
    ],
)
def test_addresses(text, expected):
    assert parse_address(text) == expected


@pytest.mark.parametrize("text", ["", "host", ":4000", "host:", "host:0", "host:70000", "h:p"])
def test_bad_addresses(text):
    with pytest.raises(ValueError, match="host:port"):
        parse_address(text)


# -- the synthetic host ------------------------------------------------------------------

LAYOUT = Layout(nbytes=64 * 1024, layers=3)


def test_layout_is_parsed_from_an_assign_prompt():
    assert Layout.parse("bytes=65536 layers=3") == LAYOUT
    assert Layout.parse(LAYOUT.describe()) == LAYOUT
    assert Layout.parse("bytes=4096").layers == 4
    with pytest.raises(ValueError, match="not a synthetic layout"):
        Layout.parse("a red fox")
    with pytest.raises(ValueError, match="too small"):
        Layout(nbytes=10, layers=3)
    tensors = initial_state(LAYOUT, 0)
    assert nbytes(tensors) <= LAYOUT.nbytes and tensors[-1].numel() == MISC_NUMEL


def test_synthetic_state_follows_its_chunks_and_seed():
    host = SyntheticHost("wa", LAYOUT)
    host.add("s", seed=3, epoch=1)
    for _ in range(7):
        host.advance("s")
    assert all(
        torch.equal(a, b)
        for a, b in zip(host.state("s"), expected_state(LAYOUT, 3, 7), strict=True)
    )
    assert not all(
        torch.equal(a, b)
        for a, b in zip(host.state("s"), expected_state(LAYOUT, 3, 6), strict=True)
    )
    assert not torch.equal(expected_state(LAYOUT, 4, 7)[0], host.state("s")[0])
    assert host.sessions["s"].produced == list(range(7))


def test_synthetic_freeze_refusals_and_admission():
    host = SyntheticHost("wb", LAYOUT, capacity=2)

    async def freeze(sid, epoch):
        return await host.freeze(sid, epoch, on_device=False)

    with pytest.raises(HostRefused) as refused:
        asyncio.run(freeze("nobody", 1))
    assert refused.value.code is HandoffCode.UNKNOWN_SESSION
    host.add("s", seed=0, epoch=2)
    with pytest.raises(HostRefused) as refused:
        asyncio.run(freeze("s", 1))
    assert refused.value.code is HandoffCode.STALE_EPOCH
    frozen = asyncio.run(freeze("s", 2))
    assert host.advance("s") is None  # frozen: it does not play
    with pytest.raises(HostRefused) as refused:
        asyncio.run(freeze("s", 2))
    assert refused.value.code is HandoffCode.BUSY

    incoming = frozen_from(
        offer_for(
            [*frozen.snapshot.layers, frozen.snapshot.misc],
            session_id="other",
            preset="synthetic",
            meta=dict(frozen.snapshot.meta),
        ),
        [*frozen.snapshot.layers, frozen.snapshot.misc],
    )
    assert host.admission(incoming) is None
    host.reserve("r1")
    assert host.admission(incoming).code is HandoffCode.FULL
    host.unreserve("r1")
    host.draining = True
    assert host.admission(incoming).code is HandoffCode.DRAINING
    host.draining = False
    incoming.snapshot.meta["layout"] = "1x1+64:float32"
    assert host.admission(incoming).code is HandoffCode.INCOMPATIBLE
    incoming.snapshot.session_id = "s"
    assert host.admission(incoming).code is HandoffCode.EXISTS
