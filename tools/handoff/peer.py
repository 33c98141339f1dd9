"""A stand-in worker process: a :class:`HandoffEndpoint` over a :class:`SyntheticHost`, driven
by ordinary worker commands on ``<prefix>.worker.<id>.cmd`` (requests, answered with a
``CommandReply``). ``turboserve bench migration`` runs two of them; the integration tests run
them to kill one mid-handoff.

    python -m tools.handoff.peer [--device cpu] [--no-checksum]

Settings come from the usual ``TURBOSERVE_*`` variables (worker id, NATS, Redis, prefix,
namespace, ``TURBOSERVE_HANDOFF_*``). Commands:

- ``assign``: hold a new session (``session_id``, ``seed``, ``epoch``); its ``prompt`` names the
  state's layout, ``bytes=N layers=K`` (synthetic state has no prompt to condition on);
- ``migrate``: answered at once (the handoff started); the endpoint publishes its
  ``MigrationReport`` on ``<prefix>.migrations``;
- ``stop``: forget the session; ``drain`` / ``undrain``: refuse / take offers.
"""

from __future__ import annotations

import argparse
import sys

from nats.aio.msg import Msg

from services.gpu_worker.handoff.endpoint import HandoffEndpoint
from shared.runner import ServiceContext, run_service
from shared.settings import SettingsError, WorkerSettings
from shared.wire import CommandReply, WorkerCmdKind, WorkerCommand, decode_or_drop, encode
from tools.handoff.synthetic import Layout, SyntheticHost

_DEFAULT_LAYOUT = Layout(nbytes=1 << 20)


class PeerService:
    name = "handoff-peer"

    def __init__(self, settings: WorkerSettings, device: str, checksum: bool) -> None:
        self.settings = settings
        self.host = SyntheticHost(
            settings.worker_id, _DEFAULT_LAYOUT, device=device, capacity=settings.slots
        )
        self.checksum = checksum
        self.endpoint: HandoffEndpoint | None = None
        self.ctx: ServiceContext | None = None

    async def start(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self.endpoint = HandoffEndpoint(
            ctx.nc, ctx.registry, ctx.subjects, self.host, self.settings, checksum=self.checksum
        )
        await self.endpoint.start()
        await ctx.nc.subscribe(ctx.subjects.worker_cmd(self.host.worker_id), cb=self._on_command)

    async def stop(self) -> None:
        if self.endpoint is not None:
            await self.endpoint.close()

    async def _on_command(self, msg: Msg) -> None:
        assert self.ctx is not None and self.endpoint is not None
        cmd = decode_or_drop(msg.subject, msg.data, WorkerCommand, self.endpoint.log)
        if cmd is None:
            return
        code, detail = self._apply(cmd)
        if msg.reply:
            await msg.respond(
                encode(
                    CommandReply(
                        worker_id=self.host.worker_id,
                        ok=not code,
                        command_id=cmd.command_id,
                        code=code,
                        detail=detail,
                    )
                )
            )

    def _apply(self, cmd: WorkerCommand) -> tuple[str, str]:
        assert self.ctx is not None and self.endpoint is not None
        host, sid = self.host, cmd.session_id or ""
        if cmd.kind is WorkerCmdKind.DRAIN:
            host.draining = True
        elif cmd.kind is WorkerCmdKind.UNDRAIN:
            host.draining = False
        elif cmd.kind is WorkerCmdKind.ASSIGN and sid:
            try:
                layout = Layout.parse(cmd.prompt or "")
            except ValueError as exc:
                return "invalid_request", str(exc)
            host.add(sid, cmd.seed or 0, cmd.epoch, cmd.prompt or "", layout=layout)
        elif cmd.kind is WorkerCmdKind.STOP and sid:
            host.sessions.pop(sid, None)
        elif cmd.kind is WorkerCmdKind.MIGRATE:
            self.ctx.spawn(self.endpoint.migrate(cmd), name=f"migrate-{sid}")
        else:
            return "unsupported", f"the synthetic peer does not do {cmd.kind}"
        return "", ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.handoff.peer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda:N")
    parser.add_argument(
        "--checksum",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="offers carry a keyed checksum, and offers here must (default: on)",
    )
    args = parser.parse_args(argv)
    try:
        settings = WorkerSettings.from_env()
    except SettingsError as exc:
        print(f"handoff peer: {exc}", file=sys.stderr)
        return 2
    return run_service(
        lambda: PeerService(settings, args.device, args.checksum), settings, "handoff-peer"
    )


if __name__ == "__main__":
    sys.exit(main())
