"""The headline: the evaluation's key figures in one line per profile and scale.

``turboserve sim tables`` prints it as the section ``headline``; ``--write README.md --only
headline`` puts it in the README, between its markers, so that the README's headline is what
an evaluation document says and names the profile, the scale and the sweep it came from. Every
figure is the cost to serve 99% of chunk periods on time (stall-adjusted), the one measure
the evaluation compares policies by.
"""

from __future__ import annotations

from typing import Any

from lab.eval.service_level import summary_blocks

__all__ = ["headline"]


def headline(document: dict[str, Any]) -> str:
    """A markdown bullet per profile and scale of a ``sim evaluate --json`` document."""
    lines = []
    for scale, profiles in _by_scale(document):
        for name, doc in profiles.items():
            lines.append(_line(name, scale, doc))
    return "\n".join(lines)


def _by_scale(document: dict[str, Any]) -> list[tuple[int, dict[str, dict[str, Any]]]]:
    """(scale, profile name -> its document) for every scale of ``document``, smallest first."""
    by_scale = document.get("by_scale")
    if by_scale:
        return sorted((int(s), block["by_profile"]) for s, block in by_scale.items())
    profiles = document.get("by_profile") or {document["config"]["profile"]: document}
    return [(int(document.get("scale", 1)), profiles)]


def _line(profile: str, scale: int, doc: dict[str, Any]) -> str:
    summary, traces = doc["summary"], doc["traces"]
    # The service-level blocks as the tables read them (an older document's are recomputed).
    blocks = (
        summary_blocks(summary, traces) if "cost_reduction_at_matched_slo_pct" in summary else {}
    )
    sweep = "quick sweeps" if doc["config"].get("quick") else "full sweeps"
    where = "the traces' own scale" if scale == 1 else f"{scale} copies of each superposed"
    parts = [
        _against_static(blocks.get("cost_reduction_at_matched_slo_pct")),
        _clairvoyant(summary),
        _robustness(blocks.get("robustness")),
    ]
    budget = _quality_budget(summary)
    if budget:
        parts.append(budget)
    return (
        f"- **`{profile}`, scale {scale}** ({len(traces)} traces at {where}, {sweep}): "
        + "; ".join(p for p in parts if p)
        + "."
    )


def _pct(value: float) -> str:
    return f"{value:+.1f}%"


def _against_static(block: dict[str, Any] | None) -> str:
    if not block or block.get("avg_vs_best_baseline") is None:
        return "the cost against the best static pool was not reached"
    # The block holds reductions (positive: cheaper); the headline says the change in cost.
    text = (
        f"{_pct(-block['avg_vs_best_baseline'])} against the best static pool on average "
        f"(worst {_pct(-block['worst_vs_best_baseline'])}, `{block['worst_trace']}`)"
    )
    return text + _left_out(block)


def _clairvoyant(summary: dict[str, Any]) -> str:
    block = summary.get("gap_to_clairvoyant_at_slo_pct")
    if not block or block.get("avg") is None:
        return ""
    bounds = block.get("bounds") or {}
    lower = sum(1 for b in bounds.values() if b == "at least")
    text = f"{_pct(block['avg'])} above the clairvoyant (max {_pct(block['max'])}"
    if lower:
        text += f"; lower bounds on {lower} of {block['traces_averaged']} traces"
    return text + ")" + _left_out(block)


def _robustness(block: dict[str, Any] | None) -> str:
    if not block or block.get("max_cost_above_best_of_least_loaded_and_hpa_pct") is None:
        return ""
    # A trace where a side did not reach 99% has no figure (None).
    per_trace = {t: v for t, v in (block.get("per_trace") or {}).items() if v is not None}
    worst = max(per_trace, key=lambda t: per_trace[t]) if per_trace else None
    verdict = "meets" if block.get("met") else "misses"
    return (
        f"worst {_pct(block['max_cost_above_best_of_least_loaded_and_hpa_pct'])} against the "
        f"cheaper of static least_loaded and HPA"
        + (f" (`{worst}`)" if worst else "")
        + f", which {verdict} the +{block['bar_pct']:g}% bar"
    )


def _quality_budget(summary: dict[str, Any]) -> str:
    block = summary.get("quality_budget")
    if not block:
        return ""
    five = (block.get("max_reduced_5pct") or {}).get("vs_turboserve_pct") or {}
    if five.get("avg") is None:
        return ""
    text = (
        f"the quality budget (`{block['policy']}`, at most 5% of chunks at fewer steps) "
        f"{_pct(five['avg'])} against turboserve without it"
    )
    left = five.get("left_out") or []
    if left:
        text += f" (over {five['traces']} traces; left out: {', '.join(left)})"
    return text


def _left_out(block: dict[str, Any]) -> str:
    out = block.get("left_out") or {}
    return f" (left out: {', '.join(out)})" if out else ""
