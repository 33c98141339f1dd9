"""How every ``turboserve`` subcommand, service or tool, reports a user error."""

from __future__ import annotations

import sys


def fail(command: str, message: object) -> int:
    """Report a user error of ``turboserve <command>`` in one line on stderr (no traceback);
    returns the exit code for it. Every subcommand reports bad input this way."""
    print(f"turboserve {command}: {message}", file=sys.stderr)
    return 2
