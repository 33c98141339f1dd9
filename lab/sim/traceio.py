"""Session traces: the CSV format of ``shared/design/evaluation.md``, read and written.

A trace is a CSV file with the header ``t,session_id,event``; ``t`` is seconds since the trace
start (non-decreasing), ``event`` one of ``arrive``, ``active``, ``idle``, ``depart``. Files
ending in ``.gz`` are gzip-compressed. Reading validates every row against the session
lifecycle (arrive -> {idle <-> active}* -> depart) and raises :class:`TraceError` naming the
file and line of the first bad row: a simulator never guesses.
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import io
import math
import os
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, NamedTuple

HEADER = ("t", "session_id", "event")
EVENTS = ("arrive", "active", "idle", "depart")


class TraceError(ValueError):
    """A row that breaks the trace format; carries where it is and what was wrong."""

    def __init__(self, source: str, line: int | None, reason: str) -> None:
        where = f"{source}:{line}" if line is not None else source
        super().__init__(f"{where}: {reason}")
        self.source = source
        self.line = line
        self.reason = reason

    def __reduce__(self) -> tuple[type[TraceError], tuple[str, int | None, str]]:
        # picklable across worker processes despite the 3-argument init
        return (type(self), (self.source, self.line, self.reason))


class TraceEvent(NamedTuple):
    t: float
    session_id: str
    event: str


@dataclass(frozen=True, slots=True)
class Trace:
    """A validated trace: events in time order; ``duration`` is the last event's time
    unless a longer one is given (sessions without ``depart`` leave then)."""

    name: str
    events: tuple[TraceEvent, ...]
    duration: float

    @property
    def sessions(self) -> int:
        return sum(1 for e in self.events if e.event == "arrive")

    def active_counts(self) -> list[tuple[float, int]]:
        """(time, active sessions just after it) at every change: the demand curve."""
        active: set[str] = set()
        out: list[tuple[float, int]] = []
        for ev in self.events:
            if ev.event in ("arrive", "active"):
                active.add(ev.session_id)
            else:
                active.discard(ev.session_id)
            if out and out[-1][0] == ev.t:
                out[-1] = (ev.t, len(active))
            else:
                out.append((ev.t, len(active)))
        return out

    def peak_active(self) -> int:
        return max((n for _, n in self.active_counts()), default=0)

    def initial_active(self, window_s: float) -> int:
        """Most sessions active at once during the first ``window_s`` seconds."""
        return max((n for t, n in self.active_counts() if t < window_s), default=0)


@contextlib.contextmanager
def _open_text(path: Path, mode: str) -> Iterator[IO[str]]:
    if path.suffix != ".gz":
        with open(path, mode, encoding="utf-8", newline="") as fh:
            yield fh
        return
    with open(path, mode + "b") as raw:
        # mtime=0 keeps written files byte-identical for the same trace.
        with gzip.GzipFile(filename="", mode=mode + "b", fileobj=raw, mtime=0) as gz:
            with io.TextIOWrapper(gz, encoding="utf-8", newline="") as fh:
                yield fh


def validate(rows: Iterable[tuple[int, list[str]]], source: str) -> Iterator[TraceEvent]:
    """Check (line number, fields) rows and yield events; raise TraceError on the first bad one."""
    state: dict[str, str] = {}  # session -> "active" | "idle" | "gone"
    last_t = 0.0
    for line, fields in rows:
        if len(fields) != 3:
            raise TraceError(
                source, line, f"expected 3 fields t,session_id,event, got {len(fields)}"
            )
        t_text, sid, kind = (f.strip() for f in fields)
        try:
            t = float(t_text)
        except ValueError:
            raise TraceError(source, line, f"time {t_text!r} is not a number") from None
        if not math.isfinite(t) or t < 0:
            raise TraceError(source, line, f"time {t_text!r} must be finite and >= 0")
        if t < last_t:
            raise TraceError(source, line, f"time {t} goes backwards (previous row {last_t})")
        if not sid:
            raise TraceError(source, line, "empty session_id")
        if kind not in EVENTS:
            raise TraceError(source, line, f"unknown event {kind!r}; expected one of {EVENTS}")
        prev = state.get(sid)
        if kind == "arrive":
            if prev is not None:
                raise TraceError(source, line, f"session {sid!r} arrives twice")
            state[sid] = "active"
        elif prev is None:
            raise TraceError(source, line, f"{kind!r} for session {sid!r} before its arrive")
        elif prev == "gone":
            raise TraceError(source, line, f"{kind!r} for session {sid!r} after its depart")
        elif kind == "depart":
            state[sid] = "gone"
        elif kind == prev:
            raise TraceError(source, line, f"session {sid!r} is already {prev}")
        else:
            state[sid] = kind
        last_t = t
        yield TraceEvent(t, sid, kind)


def read_trace(path: str | os.PathLike[str], name: str | None = None) -> Trace:
    """Read and validate a ``.csv`` or ``.csv.gz`` trace."""
    p = Path(path)
    source = str(p)
    reader = None
    try:
        with _open_text(p, "r") as fh:
            reader = csv.reader(fh)
            header = next(reader, None)
            if header is None or tuple(h.strip() for h in header) != HEADER:
                raise TraceError(source, 1, f"header must be {','.join(HEADER)}, got {header!r}")
            rows = ((reader.line_num, fields) for fields in reader if fields)
            events = tuple(validate(rows, source))
    except TraceError:
        raise
    except FileNotFoundError:
        raise
    except (OSError, EOFError, UnicodeDecodeError, zlib.error, csv.Error) as exc:
        # A corrupt or truncated gzip (BadGzipFile, EOFError, zlib.error), bytes that are not
        # UTF-8, a NUL byte, an unreadable file: an error that names the file, never a traceback.
        line = reader.line_num + 1 if reader is not None else None
        what = {
            EOFError: "truncated gzip data",
            UnicodeDecodeError: "not UTF-8 text",
            gzip.BadGzipFile: "not a valid gzip file",
        }.get(type(exc), "cannot read the file")
        if line is not None and line > 1:
            what += f" (at or after line {line})"
        raise TraceError(source, None, f"{what}: {exc}") from exc
    return Trace(name or trace_name(p), events, events[-1].t if events else 0.0)


def trace_name(path: Path) -> str:
    name = path.name
    for suffix in (".gz", ".csv"):
        name = name.removesuffix(suffix)
    return name


def write_trace(trace: Trace, path: str | os.PathLike[str]) -> Path:
    """Write ``trace`` as CSV (gzip when the name ends in ``.gz``); times to the millisecond."""
    p = Path(path)
    with _open_text(p, "w") as fh:
        writer = csv.writer(fh, lineterminator="\n")
        writer.writerow(HEADER)
        for ev in trace.events:
            writer.writerow((f"{ev.t:.3f}", ev.session_id, ev.event))
    return p


def make_trace(name: str, events: Iterable[tuple[float, str, str]]) -> Trace:
    """Build a validated trace from (t, session_id, event) tuples, sorted stably by time."""
    ordered = sorted(events, key=lambda e: e[0])
    rows = ((i + 2, [repr(t), sid, kind]) for i, (t, sid, kind) in enumerate(ordered))
    evs = tuple(validate(rows, f"<{name}>"))
    return Trace(name, evs, evs[-1].t if evs else 0.0)
