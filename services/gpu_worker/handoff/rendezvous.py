"""Pairs formed on demand, without a global process group.

Every worker hosts a ``torch.distributed.TCPStore`` server; its address (``host:port``) is the
``handoff_addr`` it advertises and the ``store`` of every offer it sends. A communicator
carries state in one direction, from a source to a destination (a *link*): the source is rank
0 and hosts the rendezvous, the destination is rank 1 and joins it through a client of the
source's store. Each link has a fresh id, and the communicator is built over a ``PrefixStore``
named by it, so a rebuilt link never reads a stale key of an earlier one.

Why per direction and hosted by the sender: the sender's address travels in its offer, so
neither side needs a registry lookup; and two workers migrating to each other at the same
moment use two communicators, so their transfers can never wait on each other (with NCCL, two
sends posted first on one communicator would deadlock).

All calls here block: the endpoint runs them in its threads, never on the event loop.
"""

from __future__ import annotations

import secrets
import socket
import threading
from datetime import timedelta

# torch.distributed re-exports these without declaring it; their stubs live here.
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore


def new_link_id() -> str:
    return secrets.token_hex(6)


def link_prefix(link_id: str) -> str:
    return f"handoff/{link_id}/"


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` (an IPv6 host in brackets) -> (host, port); ValueError if malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"not a host:port address: {address!r}")
    return host.strip("[]"), int(port)


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host`` only (0: a free port). ``TCPStore``'s own server listens
    on every interface whatever host it is given, so the store is handed this one instead: the
    rendezvous is reachable at the address the worker advertises and nowhere else."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


class StoreServer:
    """This worker's rendezvous store (rank 0 of every link it sends on), listening on its
    handoff address only."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self._listener = listen(host, port)  # kept open for as long as the store serves
        self.store = TCPStore(
            host,
            self._listener.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
            master_listen_fd=self._listener.fileno(),
        )
        self.address = f"[{host}]:{self.store.port}" if ":" in host else f"{host}:{self.store.port}"

    def scoped(self, link_id: str) -> Store:
        return PrefixStore(link_prefix(link_id), self.store)


class StoreClients:
    """Clients of peers' stores, one per address, made on first use and dropped on error."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout = timedelta(seconds=timeout_s)
        self._clients: dict[str, TCPStore] = {}
        self._lock = threading.Lock()

    def scoped(self, address: str, link_id: str) -> Store:
        return PrefixStore(link_prefix(link_id), self.client(address))

    def client(self, address: str) -> TCPStore:
        with self._lock:
            client = self._clients.get(address)
        if client is None:
            host, port = parse_address(address)
            client = TCPStore(host, port, is_master=False, timeout=self.timeout)
            with self._lock:
                client = self._clients.setdefault(address, client)
        return client

    def drop(self, address: str) -> None:
        with self._lock:
            self._clients.pop(address, None)

    def clear(self) -> None:
        with self._lock:
            self._clients.clear()
