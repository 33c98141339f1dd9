"""``turboserve certs DIR``: the CA and the certificates for TLS to NATS and Redis.

Writes ``ca.crt``, ``server.crt`` / ``server.key`` (for NATS and Redis) and ``client.crt`` /
``client.key`` (for every service) to DIR (shared/tls.py). Files already there are kept, so
that a restarted deployment keeps its certificates; ``--force`` makes new ones. Compose runs it
once before NATS and Redis start; on Kubernetes its output becomes the ``turboserve-tls``
Secret (docs/security.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shared.tls import (
    CA_FILE,
    CLIENT_CERT,
    CLIENT_KEY,
    DEFAULT_SERVER_NAMES,
    SERVER_CERT,
    SERVER_KEY,
    generate,
)

FILES = (CA_FILE, SERVER_CERT, SERVER_KEY, CLIENT_CERT, CLIENT_KEY)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "certs",
        help="write a CA and the certificates for TLS to NATS and Redis",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("directory", type=Path, help="where the five files go")
    p.add_argument(
        "--name",
        action="append",
        default=[],
        help="another host name or IP address the servers are reached at (repeatable; "
        f"always: {', '.join(DEFAULT_SERVER_NAMES)})",
    )
    p.add_argument("--force", action="store_true", help="replace certificates already there")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    there = [name for name in FILES if (args.directory / name).exists()]
    if there and not args.force:
        if len(there) == len(FILES):
            print(f"turboserve certs: {args.directory} has its certificates already; kept")
            return 0
        print(
            f"turboserve certs: {args.directory} has only {', '.join(there)}: pass --force to "
            "make a new set",
            file=sys.stderr,
        )
        return 1
    names = [*DEFAULT_SERVER_NAMES, *(n for n in args.name if n not in DEFAULT_SERVER_NAMES)]
    certs = generate(args.directory, names)
    print(
        f"turboserve certs: wrote {', '.join(FILES)} to {certs.directory} "
        f"(servers: {', '.join(names)})"
    )
    return 0
