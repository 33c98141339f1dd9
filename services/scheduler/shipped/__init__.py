"""The autoscaler's fitted tables the scheduler ships, and reading and writing them.

The policy core (``services.scheduler.core``) reads no files: its callers (the live service,
the CLIs, the simulator, the evaluation) load the adaptive rho_hat table here (and a latency
profile with :func:`shared.profile.load_profile`) and hand the core the values.

* ``rho_table.json``: the adaptive rho_hat table (``RhoTable``), written by
  ``turboserve sim profile``, fitted with the default profile; ``rho_table_<profile>.json``:
  one fitted with another profile (``table_path_for``), used with that profile.
"""

from __future__ import annotations

import json
from pathlib import Path

from services.scheduler.core.autoscale import RhoTable, RhoTableError
from shared.profile import DEFAULT_PROFILE

DEFAULT_TABLE_PATH = Path(__file__).with_name("rho_table.json")

__all__ = [
    "DEFAULT_TABLE_PATH",
    "load_rho_table",
    "save_rho_table",
    "table_path_for",
]


def table_path_for(profile_name: str | None) -> Path:
    """The shipped table for a profile: ``rho_table_<name>.json`` when one was fitted with it,
    else the default ``rho_table.json``."""
    if profile_name and profile_name != DEFAULT_PROFILE:
        own = DEFAULT_TABLE_PATH.with_name(f"rho_table_{profile_name}.json")
        if own.is_file():
            return own
    return DEFAULT_TABLE_PATH


def load_rho_table(path: str | Path | None = None) -> RhoTable | None:
    """The table at ``path`` (default: the shipped ``rho_table.json``); None if the default
    file is absent (the core then uses its fixed rho_hat). A named file that is missing, or
    any malformed file, raises (:class:`FileNotFoundError`, :class:`RhoTableError`)."""
    target = Path(path) if path is not None else DEFAULT_TABLE_PATH
    if not target.is_file():
        if path is None:
            return None
        raise FileNotFoundError(f"rho table {target}: no such file")
    try:
        raw = json.loads(target.read_text())
    except json.JSONDecodeError as exc:
        raise RhoTableError(f"rho table {target}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise RhoTableError(f"rho table {target}: top level must be a JSON object")
    try:
        return RhoTable.from_dict(raw)
    except ValueError as exc:  # a field out of range, or a value that is not a number
        raise RhoTableError(f"{target}: {exc}") from exc


def save_rho_table(table: RhoTable, path: str | Path | None = None) -> Path:
    target = Path(path) if path is not None else DEFAULT_TABLE_PATH
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(table.to_dict(), indent=2) + "\n")
    return target
