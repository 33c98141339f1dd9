"""The stable codes a handoff ends with: in a refusing ``HandoffAnswer``, a failed
``HandoffOutcome`` and the ``MigrationReport`` the requester gets (no torch, no I/O)."""

from __future__ import annotations

import enum


class HandoffCode(enum.StrEnum):
    # The command itself.
    INVALID_COMMAND = "invalid_command"  # not a MIGRATE with a session and another worker
    # The source refuses before anything moves (StateHost.freeze, or the registry CAS).
    UNKNOWN_SESSION = "unknown_session"  # the worker does not hold the session
    STALE_EPOCH = "stale_epoch"  # the session moved on since the command was issued
    BUSY = "busy"  # the session is already being handed off
    HOST_ERROR = "host_error"  # the worker's state host failed (an error, not a refusal)
    # The destination refuses the offer (HandoffAnswer).
    DRAINING = "draining"
    FULL = "full"
    EXISTS = "exists"  # it already holds the session
    INCOMPATIBLE = "incompatible"  # other preset, dtype, weights, or no transport fits
    INVALID_OFFER = "invalid_offer"  # the offer contradicts itself (specs vs bytes, ...)
    # Failures after the destination accepted.
    UNREACHABLE = "unreachable"  # no destination answered the offer
    TRANSFER_FAILED = "transfer_failed"  # the transport broke (a peer died, a timeout, ...)
    VERIFICATION_FAILED = "verification_failed"  # shapes, dtypes, bytes or checksum differ
    TIMEOUT = "timeout"  # the handoff did not finish within ``handoff_timeout_s``
    ABORTED = "aborted"  # the source gave up (its notice to the destination)
    # After the commit.
    ADOPT_FAILED = "adopt_failed"  # committed, but the destination could not import it
    LOST = "lost"  # the session was taken over or ended while it was migrating
    REGISTRY_UNAVAILABLE = "registry_unavailable"  # the abort could not be written
