"""Servers a test starts as processes, by port: one killed on purpose, the rest stopped after."""

from __future__ import annotations

import subprocess


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
