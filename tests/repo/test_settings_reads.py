"""Every ``TURBOSERVE_*`` setting is read through ``shared/settings.py``, and only there are the
NATS and Redis default URLs written.

The check walks the syntax tree of every module under services, tools, shared and tests: a
``TURBOSERVE_*`` variable read from the process environment (``os.environ.get``,
``os.environ[...]``, ``os.getenv``; the name written out or an f-string that starts with it)
or a default NATS/Redis URL literal anywhere else is a fault. Writing such a variable into a
child's environment is not a read and passes.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TREES = ("services", "tools", "shared", "tests")
SETTINGS = ROOT / "shared" / "settings.py"
PREFIX = "TURBOSERVE_"
DEFAULT_URL = re.compile(r"(nats|redis)://(127\.0\.0\.1|localhost|\[::1\]):(4222|6379)\b")


def _is_environ(node: ast.expr) -> bool:
    """``os.environ`` or a bare ``environ`` (``from os import environ``)."""
    if isinstance(node, ast.Attribute):
        return node.attr == "environ" and isinstance(node.value, ast.Name) and node.value.id == "os"
    return isinstance(node, ast.Name) and node.id == "environ"


def _is_getenv(node: ast.expr) -> bool:
    if isinstance(node, ast.Attribute):
        return node.attr == "getenv" and isinstance(node.value, ast.Name) and node.value.id == "os"
    return isinstance(node, ast.Name) and node.id == "getenv"


def _names_a_setting(node: ast.expr | None) -> bool:
    """The key is ``"TURBOSERVE_..."`` or an f-string that starts with it."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value.startswith(PREFIX)
    if isinstance(node, ast.JoinedStr) and node.values:
        first = node.values[0]
        return isinstance(first, ast.Constant) and str(first.value).startswith(PREFIX)
    return False


def faults_in(source: str, where: str) -> list[str]:
    """Each read of a ``TURBOSERVE_*`` variable and each default URL literal in ``source``."""
    faults = []
    for node in ast.walk(ast.parse(source, where)):
        key: ast.expr | None = None
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if _is_getenv(func) or (
                isinstance(func, ast.Attribute) and func.attr == "get" and _is_environ(func.value)
            ):
                key = node.args[0]
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.ctx, ast.Load)
            and _is_environ(node.value)
        ):
            key = node.slice
        if key is not None and _names_a_setting(key):
            faults.append(
                f"{where}:{key.lineno}: reads {ast.unparse(key)} from the environment "
                "(use shared.settings)"
            )
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and DEFAULT_URL.search(node.value)
        ):
            faults.append(
                f"{where}:{node.lineno}: the default URL {node.value!r} (use "
                "shared.settings' DEFAULT_NATS_URL / DEFAULT_REDIS_URL)"
            )
    return faults


def test_settings_are_read_only_through_shared_settings() -> None:
    faults = []
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*.py")):
            if path == SETTINGS:
                continue
            faults += faults_in(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    assert faults == []


@pytest.mark.parametrize(
    "snippet",
    [
        'import os\nport = os.environ.get("TURBOSERVE_PORT", "8080")',
        'import os\nos.getenv("TURBOSERVE_NATS_URL")',
        'import os\nurl = os.environ["TURBOSERVE_REDIS_URL"]',
        'from os import environ\nlevel = environ.get("TURBOSERVE_LOG_LEVEL")',
        'import os\nvalue = os.environ.get(f"TURBOSERVE_{name.upper()}")',
        'NATS = "nats://127.0.0.1:' + '4222"',  # split: this file must pass the check itself
        'def connect(url: str = "redis://localhost:' + '6379/0") -> None: ...',
    ],
)
def test_the_check_finds_a_read_or_a_default_url(snippet: str) -> None:
    assert len(faults_in(snippet, "made_up.py")) == 1


@pytest.mark.parametrize(
    "snippet",
    [
        'import os\nenv = {**os.environ, "TURBOSERVE_PORT": "8081"}',
        'import os\nos.environ["TURBOSERVE_LOG_LEVEL"] = "debug"',
        'import os\nconfig = os.environ.get("KUBECONFIG")',
        'url = f"nats://127.0.0.1:{port}"',
        'env = {k: v for k, v in os.environ.items() if not k.startswith("TURBOSERVE_")}',
    ],
)
def test_the_check_passes_a_write_or_another_variable(snippet: str) -> None:
    assert faults_in(snippet, "made_up.py") == []
