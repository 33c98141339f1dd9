"""A command's fencing at the worker: it comes from the scheduler that leads now, and a
session's command carries the epoch at which the registry gives that session to this worker.

A deposed scheduler's commands are refused by their term; a command for a session that moved on
(a newer epoch, another owner) by its epoch. Both are read from the registry as the command
arrives.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.leader import leader_key, parse_term
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

    async def faults(self, cmd: WorkerCommand, *, session: bool) -> Faults:
        """The command's term (when it carries one) and, with ``session``, its epoch and
        owner, as the registry has them now; the epoch is not read once the term failed."""
        if cmd.term and not await self._term_current(cmd.term):
            return Faults(leader=f"term {cmd.term} no longer leads the scheduling")
        if not session:
            return Faults()
        return Faults(epoch=await self._epoch_fault(cmd))

    async def _term_current(self, term: int) -> bool:
        raw = await self.registry.r.get(leader_key(self.registry.ns))
        return parse_term(raw) == term

    async def _epoch_fault(self, cmd: WorkerCommand) -> str:
        assert cmd.session_id is not None
        record = await self.registry.get_session(cmd.session_id)
        if record is None:
            return "no such session"
        if record.owner != self.worker_id or record.epoch != cmd.epoch:
            return (
                f"registry has owner {record.owner} at epoch {record.epoch}, command "
                f"epoch {cmd.epoch}"
            )
        return ""
