"""The session-state handoff of a live migration: transports, rendezvous, the protocol's two
roles and their measured cost. ``docs/migration.md`` describes the whole mechanism."""

from .endpoint import HandoffEndpoint

__all__ = ["HandoffEndpoint"]
