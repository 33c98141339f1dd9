"""A stand-in worker process (``tools.handoff.peer``) that dies mid-handoff,
for the tests that kill a worker during one:

- ``--fault die_in_recv``: as the destination, it dies once the state has started to arrive
  (and never returns from the receive, so it can never commit);
- ``--fault die_in_send``: as the source, it dies when it is about to send the state, after
  the destination accepted the offer.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from services.gpu_worker.handoff import transports
from tools.handoff import peer

EXIT_CODE = 17


def _die_after(delay_s: float) -> None:
    threading.Timer(delay_s, os._exit, args=(EXIT_CODE,)).start()


def main() -> int:
    args = sys.argv[1:]
    at = args.index("--fault")
    fault = args[at + 1]
    del args[at : at + 2]
    gloo = transports.GlooTransport
    if fault == "die_in_recv":
        recv = gloo.recv

        def dying_recv(self, *a, **kw):
            _die_after(0.01)
            recv(self, *a, **kw)
            time.sleep(3600)  # the transfer may finish first: never commit it

        gloo.recv = dying_recv  # type: ignore[method-assign]  # the fault this child plays
    elif fault == "die_in_send":

        def dying_send(self, *a, **kw):
            os._exit(EXIT_CODE)

        gloo.send = dying_send  # type: ignore[method-assign]
    else:
        print(f"unknown fault {fault!r}", file=sys.stderr)
        return 2
    return peer.main(args)


if __name__ == "__main__":
    sys.exit(main())
