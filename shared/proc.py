"""Child-process helpers shared by the launcher and the provisioner's local backend."""

from __future__ import annotations

import contextlib
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn``: the child gets SIGTERM when its parent dies (Linux), so a killed parent
    leaves no orphan behind. Elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
