"""The docs document what exists: every setting (docs/settings.md), every `turboserve up` flag
and every package (README.md); and they name no setting, path, linked file or README anchor that
does not exist."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

from shared import settings as settings_mod
from tools.launcher import register as register_up

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
SETTINGS_DOC = (ROOT / "docs" / "settings.md").read_text()
SETUP = (ROOT / "scripts" / "setup.sh").read_text()
DOCS = {
    path.relative_to(ROOT).as_posix(): path.read_text()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
}


def setting_names() -> set[str]:
    names = set()
    for obj in vars(settings_mod).values():
        if isinstance(obj, type) and issubclass(obj, settings_mod.CommonSettings):
            names |= {f"TURBOSERVE_{f.name.upper()}" for f in dataclasses.fields(obj)}
    return names


def setup_names() -> set[str]:
    """The variables only the setup script reads (before any settings class exists)."""
    return set(re.findall(r"\$\{(TURBOSERVE_[A-Z0-9_]+)", SETUP))


def test_every_setting_is_in_the_settings_doc() -> None:
    missing = sorted(
        name for name in setting_names() | setup_names() if f"`{name}`" not in SETTINGS_DOC
    )
    assert not missing, f"settings docs/settings.md does not document: {missing}"


def test_every_documented_setting_exists() -> None:
    known = setting_names() | setup_names()
    unknown = sorted(
        f"{path}: {name}"
        for path, text in DOCS.items()
        for name in set(re.findall(r"TURBOSERVE_[A-Z0-9_]+", text))
        if name not in known
    )
    assert not unknown, f"the docs name settings that do not exist: {unknown}"


def test_every_up_flag_is_in_the_readme() -> None:
    parser = argparse.ArgumentParser()
    register_up(parser.add_subparsers())
    up = parser._subparsers._group_actions[0].choices["up"]  # type: ignore[union-attr,index]  # noqa: SLF001
    flags = {s for a in up._actions for s in a.option_strings if s.startswith("--")}
    missing = sorted(f for f in flags - {"--help"} if f"`{f}" not in README)
    assert not missing, f"`turboserve up` flags the README does not document: {missing}"


def test_the_readme_stays_short() -> None:
    assert len(README.splitlines()) <= 220, "the README is a front page: details go in docs/"


def test_every_relative_link_in_the_docs_resolves() -> None:
    broken = []
    for path, text in DOCS.items():
        base = (ROOT / path).parent
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (base / target).exists():
                broken.append(f"{path}: {target}")
    assert not broken, f"links to files that do not exist: {broken}"


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readmes_links_into_the_docs_land_on_a_heading() -> None:
    broken = []
    for target, anchor in re.findall(r"\]\((docs/[^)#\s]+\.md)#([^)\s]+)\)", README):
        headings = re.findall(r"^#+ (.+)$", (ROOT / target).read_text(), re.MULTILINE)
        if anchor not in {slug(h) for h in headings}:
            broken.append(f"{target}#{anchor}")
    assert not broken, f"README links to headings that do not exist: {broken}"


def test_slug_is_githubs() -> None:
    assert slug("GPU cost to serve 99% of chunk periods on time, per trace") == (
        "gpu-cost-to-serve-99-of-chunk-periods-on-time-per-trace"
    )
    assert slug("WebRTC in bench stream") == "webrtc-in-bench-stream"
    assert slug("The stand-in model's frames") == "the-stand-in-models-frames"


def test_the_readmes_map_lists_every_package() -> None:
    packages = sorted(
        {
            init.parent.relative_to(ROOT).as_posix() + "/"
            for top in ("shared", "services", "tools")
            for init in (ROOT / top).rglob("__init__.py")
        }
        - {"services/"}
    )
    missing = [p for p in packages if f"`{p}`" not in README]
    assert not missing, f"packages the README's map leaves out: {missing}"


def test_every_path_the_docs_name_exists() -> None:
    missing = sorted(
        f"{path}: {named}"
        for path, text in DOCS.items()
        for named in set(
            re.findall(r"`((?:shared|services|tools|tests|docs|scripts|deploy)/[\w./-]*)`", text)
        )
        if not (ROOT / named).exists()
    )
    assert not missing, f"the docs name paths that do not exist: {missing}"


def test_the_maps_shared_row_names_every_shared_module() -> None:
    row = next(line for line in README.splitlines() if line.startswith("| `shared/` |"))
    named = set(re.findall(r"`(\w+\.py)`", row))
    modules = {p.name for p in (ROOT / "shared").glob("*.py")} - {"__init__.py"}
    assert named == modules, (
        f"shared/ modules the map leaves out: {sorted(modules - named)}; "
        f"named but gone: {sorted(named - modules)}"
    )
