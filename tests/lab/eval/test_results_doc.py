"""``turboserve sim tables --write``: the generated tables land in docs/results.md between their
markers, and nothing else in the file changes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lab.eval import results
from tests.lab.eval.test_not_reached import document  # noqa: F401  (the fixture)
from tools.cli import main

RESULTS_DOC = Path(__file__).resolve().parents[3] / "docs" / "results.md"


def _markers(names: list[str]) -> str:
    return "".join(f"<!-- sim tables: {n} -->\nold {n}\n<!-- /sim tables: {n} -->\n" for n in names)


def test_each_section_replaces_only_what_is_between_its_markers() -> None:
    text = "# Results\n\nintro\n\n" + _markers(["policy_all", "service_level"]) + "\nthe end\n"
    out = results.write_sections(text, {"policy_all": "| new |", "service_level": "| t |"})
    assert out == (
        "# Results\n\nintro\n\n"
        "<!-- sim tables: policy_all -->\n| new |\n<!-- /sim tables: policy_all -->\n"
        "<!-- sim tables: service_level -->\n| t |\n<!-- /sim tables: service_level -->\n"
        "\nthe end\n"
    )


def test_a_missing_marker_is_an_error() -> None:
    with pytest.raises(ValueError, match="sim tables: bench_scheduler"):
        results.write_sections(_markers(["policy_all"]), {"bench_scheduler": "| x |"})


def test_the_results_doc_has_every_section() -> None:
    text = RESULTS_DOC.read_text()
    out = results.write_sections(text, {name: f"(table {name})" for name in results.SECTIONS})
    assert all(f"(table {name})" in out for name in results.SECTIONS)


def test_sim_tables_writes_the_file(
    document: dict[str, Any],  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(results, "_policy_all", lambda: "(sim run table)")
    path = tmp_path / "eval.json"
    path.write_text(json.dumps(document))
    target = tmp_path / "results.md"
    names = ["headline", "policy_all", "against_the_paper", "service_level"]
    target.write_text("kept above\n" + _markers(names) + "kept below\n")
    assert main(["sim", "tables", "--eval", str(path), "--no-bench", "--write", str(target)]) == 0
    written = target.read_text()
    assert written.startswith("kept above\n") and written.endswith("kept below\n")
    assert "(sim run table)" in written and "| aside" in written
    assert "old " not in written
    assert f"wrote {target}" in capsys.readouterr().err


@pytest.mark.parametrize("content", [None, "no markers here\n"])
def test_sim_tables_refuses_a_file_it_cannot_write(
    document: dict[str, Any],  # noqa: F811
    tmp_path: Path,
    content: str | None,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(results, "_policy_all", lambda: "(sim run table)")
    path = tmp_path / "eval.json"
    path.write_text(json.dumps(document))
    target = tmp_path / "results.md"
    if content is not None:
        target.write_text(content)
    assert main(["sim", "tables", "--eval", str(path), "--no-bench", "--write", str(target)]) == 2
    err = capsys.readouterr().err
    assert f"--write {target}" in err
    if content is not None:
        assert target.read_text() == content


def test_the_tables_say_the_scale_above_one(document: dict[str, Any]) -> None:  # noqa: F811
    at_one = results.against_the_paper(document)
    assert "scale" not in at_one.splitlines()[0]
    scaled = json.loads(json.dumps(document))
    for doc in (scaled, *scaled["by_profile"].values()):
        doc["config"]["scale"] = 4
    assert "(K = 2, scale 4)" in results.against_the_paper(scaled).splitlines()[0]
    assert "h200-wan-1.3b-measured, scale 4: turboserve GPU-h" in results.service_table(scaled)


def test_the_readme_headline_comes_from_sim_tables(
    document: dict[str, Any],  # noqa: F811
    tmp_path: Path,
) -> None:
    path = tmp_path / "eval.json"
    path.write_text(json.dumps(document))
    readme = tmp_path / "README.md"
    readme.write_text("# Title\n" + _markers(["headline"]) + "the rest\n")
    args = ["sim", "tables", "--eval", str(path), "--only", "headline", "--write", str(readme)]
    assert main(args) == 0
    written = readme.read_text()
    assert "old headline" not in written and written.endswith("the rest\n")
    assert ", scale 1** (" in written  # each line says its profile and scale
    # The repository's README carries the markers, so the command can keep it current.
    assert "<!-- sim tables: headline -->" in (RESULTS_DOC.parent.parent / "README.md").read_text()
