"""The README documents what exists: every setting and every `turboserve up` flag."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

from shared import settings as settings_mod
from tools.launcher import register as register_up

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def setting_names() -> set[str]:
    names = set()
    for obj in vars(settings_mod).values():
        if isinstance(obj, type) and issubclass(obj, settings_mod.CommonSettings):
            names |= {f"TURBOSERVE_{f.name.upper()}" for f in dataclasses.fields(obj)}
    return names


def test_every_setting_is_in_the_readme():
    missing = sorted(name for name in setting_names() if name not in README)
    assert not missing, f"settings the README does not document: {missing}"


def test_every_readme_setting_exists():
    documented = set(re.findall(r"TURBOSERVE_[A-Z0-9_]+", README))
    # Set in the environment of tools rather than read by a settings class.
    tools = {"TURBOSERVE_STATE_DIR", "TURBOSERVE_TORCH_SPEC", "TURBOSERVE_VENV",
             "TURBOSERVE_SETUP_QUIET", "TURBOSERVE_REQUIRE_BROWSER", "TURBOSERVE_API_KEY"}
    unknown = sorted(documented - setting_names() - tools)
    assert not unknown, f"the README names settings that do not exist: {unknown}"


def test_every_up_flag_is_in_the_readme():
    parser = argparse.ArgumentParser()
    register_up(parser.add_subparsers())
    up = parser._subparsers._group_actions[0].choices["up"]  # noqa: SLF001
    flags = {s for a in up._actions for s in a.option_strings if s.startswith("--")}
    missing = sorted(f for f in flags - {"--help"} if f"`{f}" not in README)
    assert not missing, f"`turboserve up` flags the README does not document: {missing}"
