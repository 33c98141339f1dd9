"""Traces by name: a file, a shipped built-in one, or either at a scale.

Apart from ``traceio.py`` (the format) because the built-in names are ``synth.py``'s, and the
generator builds on the format: the format module needs neither.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

from lab.sim import synth
from lab.sim.traceio import Trace, read_trace

TRACE_DIR = Path(__file__).with_name("traces")  # the built-in traces, shipped
_SCALED = re.compile(r"(?P<base>.+)_x(?P<scale>[0-9]+)")


def load_trace(name_or_path: str | os.PathLike[str]) -> Trace:
    """A trace by path, or a built-in one by name (shipped ``traces/<name>.csv.gz``; generated
    from its seed when the file is absent, which gives the same events); either at scale N
    by the name or path followed by ``_xN`` (``bursty_x6``: N copies superposed,
    ``synth.scaled``)."""
    p = Path(name_or_path)
    if p.is_file():
        return read_trace(p)
    shipped = TRACE_DIR / f"{name_or_path}.csv.gz"
    if shipped.is_file():
        return read_trace(shipped)
    if str(name_or_path) in synth.BUILTIN_NAMES:
        return synth.builtin_trace(str(name_or_path))
    scaled = _SCALED.fullmatch(str(name_or_path))
    if scaled is not None and int(scaled["scale"]) >= 1:
        with contextlib.suppress(FileNotFoundError):
            return synth.scaled(load_trace(scaled["base"]), int(scaled["scale"]))
    known = ", ".join(synth.BUILTIN_NAMES)
    raise FileNotFoundError(
        f"no trace file {str(p)!r} and no built-in trace of that name "
        f"(built-in: {known}; at scale N: <name>_xN)"
    )


def scale_of(name: str) -> int:
    """The scale a trace's name says (``bursty_x6``: 6); 1 for any other name."""
    m = _SCALED.fullmatch(name)
    return int(m["scale"]) if m is not None else 1
