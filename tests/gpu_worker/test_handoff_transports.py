"""The transports on their own: a gloo link between two ranks in this process (bitwise, every
dtype, reuse, receive buffers, a peer that goes away, the deadline), and the CUDA transports
between two worker processes where a GPU is present (skipped here, with the reason)."""

from __future__ import annotations

import socket
import subprocess
import threading
import time

import pytest
import torch

from services.gpu_worker.handoff.rendezvous import StoreClients, StoreServer, new_link_id
from services.gpu_worker.handoff.tensors import spec_of
from services.gpu_worker.handoff.transports import GlooTransport, TransferError
from shared.registry import Registry
from shared.wire import Subjects
from tools.handoff import harness
from tools.handoff.synthetic import Layout

CPU = torch.device("cpu")


def state() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [
        torch.randn(3, 5, generator=gen),
        torch.randn(7, generator=gen).to(torch.bfloat16),
        torch.empty(0),
        torch.randint(-9, 9, (2, 2), generator=gen),
        torch.randn(1 << 16, generator=gen).to(torch.float16),
    ]


def both(fn0, fn1):
    """Run the two ranks' calls at once (as two workers would); re-raise a rank's error."""
    out: dict[int, object] = {}

    def call(rank, fn):
        try:
            out[rank] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test below
            out[rank] = exc

    threads = [threading.Thread(target=call, args=(r, f)) for r, f in ((0, fn0), (1, fn1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out[0], out[1]


@pytest.fixture
def link():
    """A gloo link: the transport and both ranks' communicators (a dict, so that a test can
    let go of one: gloo closes its connections when the communicator is freed)."""
    server = StoreServer("127.0.0.1", 0, timeout_s=20)
    clients = StoreClients(timeout_s=20)
    link_id = new_link_id()
    gloo = GlooTransport("127.0.0.1")
    deadline = time.monotonic() + 20
    sender, receiver = both(
        lambda: gloo.connect(server.scoped(link_id), 0, CPU, deadline),
        lambda: gloo.connect(clients.scoped(server.address, link_id), 1, CPU, deadline),
    )
    ranks = {"sender": sender, "receiver": receiver}
    del sender, receiver
    yield gloo, ranks
    ranks.clear()


def test_gloo_moves_every_dtype_bit_for_bit_and_reuses_the_link(link):
    gloo, ranks = link
    sender, receiver = ranks["sender"], ranks["receiver"]
    tensors = state()
    specs = [spec_of(t) for t in tensors]
    for tag in (1024, 2048):  # two transfers over one link
        deadline = time.monotonic() + 20
        sent, got = both(
            lambda: gloo.send(sender, tensors, tag, deadline),  # noqa: B023
            lambda: gloo.recv(receiver, specs, tag, CPU, deadline),  # noqa: B023
        )
        assert sent is None
        assert [spec_of(t) for t in got] == specs
        for a, b in zip(tensors, got, strict=True):
            assert torch.equal(
                a.view(torch.uint8) if a.numel() else a, b.view(torch.uint8) if b.numel() else b
            )


def test_gloo_receives_into_buffers_that_fit(link):
    gloo, ranks = link
    sender, receiver = ranks["sender"], ranks["receiver"]
    tensors = state()
    specs = [spec_of(t) for t in tensors]
    into = [torch.empty_like(t) for t in tensors]
    deadline = time.monotonic() + 20
    _, got = both(
        lambda: gloo.send(sender, tensors, 0, deadline),
        lambda: gloo.recv(receiver, specs, 0, CPU, deadline, into),
    )
    assert all(g is i for g, i in zip(got, into, strict=True))
    assert torch.equal(into[0], tensors[0])


def test_gloo_send_fails_fast_when_the_peer_tears_down(link):
    gloo, ranks = link
    gloo.close(ranks.pop("receiver"))  # the last reference: its connections close
    started = time.monotonic()
    with pytest.raises(TransferError, match="gloo send"):
        gloo.send(ranks["sender"], state(), 0, time.monotonic() + 20)
    assert time.monotonic() - started < 10  # the closed connection, not the deadline


def test_gloo_recv_gives_up_at_the_deadline_and_the_link_is_spent(link):
    gloo, ranks = link
    receiver = ranks["receiver"]
    with pytest.raises(TransferError, match="deadline passed"):
        gloo.recv(receiver, [spec_of(torch.empty(4))], 0, CPU, time.monotonic() - 1)
    started = time.monotonic()
    with pytest.raises(TransferError, match="gloo recv"):
        gloo.recv(receiver, [spec_of(torch.empty(4))], 0, CPU, time.monotonic() + 0.5)
    assert time.monotonic() - started < 10
    # gloo closes the connection on a timeout: the link is spent on both sides (the endpoint
    # drops it on any transfer error).
    with pytest.raises(TransferError, match="gloo send"):
        gloo.send(ranks["sender"], [torch.ones(4)], 0, time.monotonic() + 5)


def test_a_link_to_a_store_that_is_not_there_fails():
    clients = StoreClients(timeout_s=1)
    gloo = GlooTransport("127.0.0.1")
    from tools.servers import free_port

    with pytest.raises(RuntimeError):
        gloo.connect(
            clients.scoped(f"127.0.0.1:{free_port()}", new_link_id()), 1, CPU, time.monotonic() + 2
        )


# -- CUDA: two worker processes, on one GPU (CUDA IPC) or two (NCCL) ------------------------

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA IPC and NCCL need a CUDA GPU; none here"
)
needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="NCCL between workers needs two CUDA GPUs",
)


async def _handoff_between_processes(infra, isolation, redis_client, nats_client, devices):
    env = {
        "TURBOSERVE_NATS_URL": infra.nats_url,
        "TURBOSERVE_REDIS_URL": infra.redis_url,
        "TURBOSERVE_LOG_LEVEL": "warning",
        **isolation,
    }
    subjects = Subjects(isolation["TURBOSERVE_SUBJECT_PREFIX"])
    registry = Registry(redis_client, isolation["TURBOSERVE_REDIS_NAMESPACE"])
    procs: list[subprocess.Popen] = []
    try:
        for wid, device in zip(("ga", "gb"), devices, strict=True):
            procs.append(harness.spawn_peer(wid, env, device=device, checksum=True))
            await harness.wait_ready(nats_client, subjects, wid, procs[-1])
        reports = harness.Reports(nats_client, subjects)
        await reports.start()
        layout = Layout(nbytes=64 << 20, layers=4)
        epoch = await harness.place(registry, nats_client, subjects, "s1", "ga", layout.describe())
        there = await reports.migrate("s1", "ga", "gb", epoch)
        back = await reports.migrate("s1", "gb", "ga", there.epoch)
        await reports.close()
        return there, back
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)


@pytest.mark.integration
@needs_cuda
async def test_cuda_ipc_between_two_processes_on_one_gpu(
    infra, isolation, redis_client, nats_client
):
    there, back = await _handoff_between_processes(
        infra, isolation, redis_client, nats_client, ("cuda:0", "cuda:0")
    )
    assert there.ok and back.ok, (there, back)  # checksummed on arrival
    assert there.transport == back.transport == "cuda_ipc"


@pytest.mark.integration
@needs_two_gpus
async def test_nccl_between_two_gpus(infra, isolation, redis_client, nats_client):
    there, back = await _handoff_between_processes(
        infra, isolation, redis_client, nats_client, ("cuda:0", "cuda:1")
    )
    assert there.ok and back.ok, (there, back)
    assert there.transport == back.transport == "nccl"


def test_the_rendezvous_listens_on_the_handoff_address_only():
    """TCPStore's own server listens on every interface; ours only where the worker said."""
    server = StoreServer("127.0.0.1", 0, timeout_s=5)
    port = server.store.port
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
    # another loopback address of this host: a server on every interface would answer there
    with pytest.raises(OSError), socket.create_connection(("127.0.0.2", port), timeout=5):
        pass
    client = StoreClients(timeout_s=5).client(server.address)
    client.set("k", "v")
    assert server.store.get("k") == b"v"
