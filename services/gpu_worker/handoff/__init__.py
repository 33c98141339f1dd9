"""The session-state handoff of a live migration: transports, rendezvous, the protocol's two
roles and their measured cost. ``docs/migration.md`` describes the whole mechanism."""

from .codes import HandoffCode
from .endpoint import HandoffEndpoint
from .host import FrozenSession, HandoffRefusal, HostRefused, StateHost
from .selection import NoTransport, Place, select_transport
from .stats import HandoffCost, HandoffSample, HandoffStats

__all__ = [
    "FrozenSession",
    "HandoffCode",
    "HandoffCost",
    "HandoffEndpoint",
    "HandoffSample",
    "HandoffStats",
    "HostRefused",
    "NoTransport",
    "Place",
    "HandoffRefusal",
    "StateHost",
    "select_transport",
]
