"""A command's fencing at the worker: it comes from the scheduler that leads now, and a
session's command carries the epoch at which the registry gives that session to this worker.

A deposed scheduler's commands are refused by their term; a command for a session that moved on
(a newer epoch, another owner) by its epoch. Both are read from the registry in one step as the
command arrives (:meth:`Registry.fencing`). The one thing kept between commands is the newest
term seen leading: terms only grow, so a command of an older term is refused without asking.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.registry import Registry
from shared.wire import WorkerCommand


@dataclass(frozen=True, slots=True)
class Faults:
    """Why a command may not be carried out (empty: no such fault)."""

    leader: str = ""  # its term no longer leads the scheduling
    epoch: str = ""  # its session is not this worker's at its epoch


class CommandFence:
    """The checks of one worker's commands against the registry."""

    def __init__(self, registry: Registry, worker_id: str) -> None:
        self.registry = registry
        self.worker_id = worker_id
        self.newest_term = 0  # the newest term seen leading

    async def faults(self, cmd: WorkerCommand, *, session: bool) -> Faults:
        """The command's term (when it carries one) and, with ``session``, its epoch and
        owner, as the registry has them now (one round trip, none for an outdated term)."""
        if cmd.term and cmd.term < self.newest_term:
            return self._leader_fault(cmd)
        sid = cmd.session_id if session else None
        found = await self.registry.fencing(sid)
        if found.term is not None:
            self.newest_term = max(self.newest_term, found.term)
        if cmd.term and found.term != cmd.term:
            return self._leader_fault(cmd)
        if sid is None:
            return Faults()
        if not found.found:
            return Faults(epoch="no such session")
        if found.owner != self.worker_id or found.epoch != cmd.epoch:
            return Faults(
                epoch=f"registry has owner {found.owner} at epoch {found.epoch}, command "
                f"epoch {cmd.epoch}"
            )
        return Faults()

    @staticmethod
    def _leader_fault(cmd: WorkerCommand) -> Faults:
        return Faults(leader=f"term {cmd.term} no longer leads the scheduling")
