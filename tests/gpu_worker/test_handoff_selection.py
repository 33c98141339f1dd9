"""Which transport carries a session's state: every case of the pure selection rule."""

from __future__ import annotations

import pytest

from services.gpu_worker.handoff.selection import (
    CUDA_IPC,
    GLOO,
    NCCL,
    NoTransport,
    Place,
    select_transport,
)

HOST = Place("cpu")
GPU_A = Place("cuda:0", "GPU-aaaa")
GPU_A_OTHER_INDEX = Place("cuda:3", "GPU-aaaa")  # the same GPU seen as another index
GPU_B = Place("cuda:1", "GPU-bbbb")
GPU_UNKNOWN = Place("cuda:0", "")


@pytest.mark.parametrize(
    ("state", "dst", "expected"),
    [
        (HOST, HOST, GLOO),  # CPU workers, or a suspended session between anything
        (HOST, GPU_A, GLOO),  # suspended state moves host to host even between GPU workers
        (GPU_A, GPU_B, NCCL),
        (GPU_A, GPU_A_OTHER_INDEX, CUDA_IPC),  # same UUID: same physical GPU, whatever the index
        (GPU_A, HOST, GLOO),  # a CPU destination: the sender copies to host memory
        (GPU_UNKNOWN, GPU_B, GLOO),  # without UUIDs we cannot tell one GPU from two
        (GPU_A, GPU_UNKNOWN, GLOO),
    ],
)
def test_auto(state, dst, expected):
    assert select_transport(state, dst) == expected


@pytest.mark.parametrize(
    ("forced", "state", "dst"),
    [
        (GLOO, GPU_A, GPU_B),
        (GLOO, GPU_A, GPU_A),
        (NCCL, GPU_A, GPU_B),
        (CUDA_IPC, GPU_A, GPU_A_OTHER_INDEX),
    ],
)
def test_forced_transport_that_fits_is_used_from_either_side(forced, state, dst):
    assert select_transport(state, dst, src_asks=forced) == forced
    assert select_transport(state, dst, dst_asks=forced) == forced
    assert select_transport(state, dst, src_asks=forced, dst_asks=forced) == forced


@pytest.mark.parametrize(
    ("forced", "state", "dst", "why"),
    [
        (NCCL, HOST, GPU_B, "host memory"),
        (NCCL, GPU_A, HOST, "no CUDA device"),
        (NCCL, GPU_A, GPU_A_OTHER_INDEX, "same GPU"),
        (CUDA_IPC, GPU_A, GPU_B, "different GPUs"),
        (CUDA_IPC, HOST, HOST, "host memory"),
        (NCCL, GPU_UNKNOWN, GPU_B, "UUID is unknown"),
    ],
)
def test_forced_transport_that_cannot_carry_the_state_is_refused(forced, state, dst, why):
    with pytest.raises(NoTransport, match=why):
        select_transport(state, dst, src_asks=forced)


def test_sides_forcing_different_transports_is_refused():
    with pytest.raises(NoTransport, match="source forces gloo, the destination nccl"):
        select_transport(GPU_A, GPU_B, src_asks=GLOO, dst_asks=NCCL)


def test_unknown_transport_names_are_refused():
    with pytest.raises(NoTransport, match="unknown transport 'ucx'"):
        select_transport(HOST, HOST, src_asks="ucx")
    with pytest.raises(NoTransport, match="destination asks for unknown"):
        select_transport(HOST, HOST, dst_asks="rdma")


@pytest.mark.parametrize(
    ("device", "dst", "expected"),
    [
        ("cuda:0", GPU_A_OTHER_INDEX, CUDA_IPC),  # frozen on the device, same GPU
        ("cuda:0", GPU_B, NCCL),  # frozen on the device, another GPU
        ("cpu", GPU_B, GLOO),  # a suspended session's host copy, from a CUDA worker
        ("cuda:0", HOST, GLOO),
    ],
)
def test_the_offer_says_where_the_frozen_state_is(device, dst, expected):
    from services.gpu_worker.handoff.source import state_place

    held = state_place(device, GPU_A)
    assert held.uuid == ("GPU-aaaa" if device.startswith("cuda") else "")
    assert select_transport(held, dst) == expected


def test_forcing_a_device_transport_on_a_host_copy_is_refused():
    from services.gpu_worker.handoff.source import state_place

    for forced in (NCCL, CUDA_IPC):
        with pytest.raises(NoTransport, match="host memory"):
            select_transport(state_place("cpu", GPU_A), GPU_B, src_asks=forced)
