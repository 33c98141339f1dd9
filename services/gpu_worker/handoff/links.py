"""The communicators a worker holds, one per (peer, direction, transport), built on first use
and torn down when a transfer over them fails or the peer leaves (``forget_peer``)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch

from .rendezvous import StoreClients, StoreServer
from .transports import TransferError, Transport

SEND = "send"  # rank 0: this worker is the source, it hosts the rendezvous
RECV = "recv"  # rank 1: this worker is the destination, it joins the source's store

Run = Callable[..., Awaitable[Any]]  # runs a blocking call in the endpoint's threads


@dataclass(slots=True)
class Link:
    peer: str
    direction: str
    transport: Transport
    link_id: str
    handle: Any
    address: str  # the source's store
    connect_ms: float


class Links:
    def __init__(self, run: Run, server: StoreServer, clients: StoreClients) -> None:
        self._run = run
        self._server = server
        self._clients = clients
        self._links: dict[tuple[str, str, str], Link] = {}

    def ids(self, peer: str, direction: str) -> dict[str, str]:
        """The cached links with ``peer`` in ``direction``: transport name -> link id."""
        return {
            t: link.link_id
            for (p, d, t), link in self._links.items()
            if p == peer and d == direction
        }

    def get(self, peer: str, direction: str, transport: str) -> Link | None:
        return self._links.get((peer, direction, transport))

    def peers(self) -> set[str]:
        return {p for p, _, _ in self._links}

    async def open(
        self,
        peer: str,
        direction: str,
        transport: Transport,
        link_id: str,
        address: str,
        device: torch.device,
        deadline: float,
    ) -> Link:
        """The link ``link_id`` with ``peer``: the cached one, or built now (both sides build
        it at once; ``connect_ms`` of a new link is the first-use cost)."""
        key = (peer, direction, transport.name)
        old = self._links.get(key)
        if old is not None and old.link_id == link_id:
            return old
        if old is not None:
            await self.drop(old)
        started = time.perf_counter()
        try:
            if direction == SEND:
                store = self._server.scoped(link_id)
            else:
                store = await self._run(self._clients.scoped, address, link_id)
            rank = 0 if direction == SEND else 1
            handle = await self._run(transport.connect, store, rank, device, deadline)
        except TransferError:
            self._clients.drop(address)
            raise
        except (RuntimeError, ValueError) as exc:  # the store: peer gone, bad address
            self._clients.drop(address)
            raise TransferError(f"rendezvous with {peer} at {address}: {exc}") from exc
        link = Link(
            peer,
            direction,
            transport,
            link_id,
            handle,
            address,
            (time.perf_counter() - started) * 1000.0,
        )
        self._links[key] = link
        return link

    async def drop(self, link: Link) -> None:
        """Forget ``link`` and tear its communicator down (idempotent)."""
        key = (link.peer, link.direction, link.transport.name)
        if self._links.get(key) is link:
            del self._links[key]
        if link.direction == RECV:
            self._clients.drop(link.address)
        try:
            await self._run(link.transport.close, link.handle)
        except RuntimeError:
            pass  # already broken: that is why it is dropped

    async def drop_peer(self, peer: str) -> int:
        links = [link for (p, _, _), link in list(self._links.items()) if p == peer]
        for link in links:
            await self.drop(link)
        return len(links)

    async def drop_all(self) -> None:
        for link in list(self._links.values()):
            await self.drop(link)
