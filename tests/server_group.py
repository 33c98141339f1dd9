"""Servers a test starts as processes, by port: one killed on purpose, the rest stopped after."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tools.servers import redis_server_binary


def start_redis(port: int, folder: Path) -> subprocess.Popen[bytes]:
    """A redis-server of the test's own on ``port``, with no persistence: started again, it
    comes back empty (a Redis restarted empty)."""
    return subprocess.Popen(
        [
            redis_server_binary(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(folder),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


class ServerGroup:
    def __init__(self) -> None:
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def kill(self, port: int) -> None:
        """SIGKILL, as a crash: the server says nothing to its clients or peers."""
        self.procs[port].kill()
        self.procs[port].wait(timeout=10)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=10)
