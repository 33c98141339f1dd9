"""The README's headline (lab/eval/headline.py): one line per profile and scale,
each figure read from the evaluation document and saying where it came from."""

from __future__ import annotations

from typing import Any

from lab.eval.headline import headline


def profile_doc(scale: int, *, static: float | None, gap: float, quick: bool) -> dict[str, Any]:
    names = ["calm", "bursty", "chaotic"]
    return {
        "scale": scale,
        "config": {"profile": "h20-x", "quick": quick, "scale": scale},
        "traces": {n if scale == 1 else f"{n}_x{scale}": {} for n in names},
        "summary": {
            "cost_reduction_at_matched_slo_pct": {
                "avg_vs_best_baseline": static,
                "worst_vs_best_baseline": -14.0,
                "worst_trace": "chaotic",
                "left_out": {} if static is not None else {"bursty": ["turboserve"]},
            },
            "gap_to_clairvoyant_at_slo_pct": {
                "avg": gap,
                "max": 2 * gap,
                "traces_averaged": 3,
                "bounds": {"calm": "at least", "bursty": "equal", "chaotic": "at least"},
                "left_out": {},
            },
            "robustness": {
                "bar_pct": 5.0,
                "max_cost_above_best_of_least_loaded_and_hpa_pct": 14.0,
                "per_trace": {"calm": -20.0, "bursty": -30.0, "chaotic": 14.0},
                "met": False,
                "left_out": {},
            },
            "quality_budget": {
                "policy": "turboserve_q",
                "max_reduced_5pct": {
                    "vs_turboserve_pct": {"avg": -8.9, "traces": 2, "left_out": ["chaotic"]}
                },
            },
        },
    }


def test_one_line_per_scale_each_saying_its_profile_scale_and_sweep():
    one, six = (
        profile_doc(1, static=11.4, gap=33.2, quick=False),
        profile_doc(6, static=2.2, gap=42.1, quick=True),
    )
    document = {
        **one,
        "by_scale": {"6": {"by_profile": {"h20-x": six}}, "1": {"by_profile": {"h20-x": one}}},
    }
    first, second = headline(document).splitlines()
    assert first.startswith(
        "- **`h20-x`, scale 1** (3 traces at the traces' own scale, full sweeps)"
    )
    assert "-11.4% against the best static pool on average (worst +14.0%, `chaotic`)" in first
    assert "+33.2% above the clairvoyant (max +66.4%; lower bounds on 2 of 3 traces)" in first
    assert "worst +14.0% against the cheaper of static least_loaded and HPA (`chaotic`)" in first
    assert "misses the +5% bar" in first
    assert "-8.9% against turboserve without it (over 2 traces; left out: chaotic)" in first
    assert second.startswith(
        "- **`h20-x`, scale 6** (3 traces at 6 copies of each superposed, quick sweeps)"
    )
    assert "-2.2% against the best static pool" in second


def test_a_figure_not_reached_says_so_instead_of_a_number():
    doc = profile_doc(1, static=None, gap=10.0, quick=True)
    doc["summary"]["robustness"]["per_trace"]["bursty"] = None  # a side did not reach 99%
    line = headline(doc)
    assert "the cost against the best static pool was not reached" in line
    assert "None" not in line
