"""``turboserve callout-key``: a new key for the NATS auth callout's issuer, as two settings.

Prints ``TURBOSERVE_CALLOUT_KEY=<private key>`` (the provisioner's, which signs its answers to
the server's callout: shared/callout.py) and ``NATS_CALLOUT_ISSUER=<account nkey>`` (its public
half, which the NATS config's ``auth_callout { issuer }`` names), ready to append to compose's
``.env`` (docs/security.md). ``--key`` prints the issuer of a key you have instead.
"""

from __future__ import annotations

import argparse
import sys

from shared.callout import CalloutError, IssuerKey


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "callout-key",
        help="a new key for the NATS auth callout (TURBOSERVE_CALLOUT_KEY, NATS_CALLOUT_ISSUER)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--key", help="print the issuer of this TURBOSERVE_CALLOUT_KEY instead")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        key = IssuerKey.from_text(args.key) if args.key else IssuerKey.generate()
    except CalloutError as exc:
        print(f"turboserve callout-key: {exc}", file=sys.stderr)
        return 2
    if not args.key:
        print(f"TURBOSERVE_CALLOUT_KEY={key.text()}")
    print(f"NATS_CALLOUT_ISSUER={key.public_nkey}")
    return 0
