"""One ``simulate`` run per setting on training traces, one JSON line each (the scale-6 rows
of ``train_s6_churn.jsonl``)::

    python lab/sweeps/staffing/probe_scale6.py SCALE SHAPE[,SHAPE] '{"confidence": 0.99}' ...

``eval:SHAPE[,SHAPE]`` runs the built-in (evaluation) traces of those shapes instead, once a
setting has been chosen on the training traces.

A setting may name ``policy`` (default ``turboserve_staffing``), e.g. a static
``{"policy": "least_loaded", "gpus": 44}``.
"""

from __future__ import annotations

import json
import sys
import time

from lab.sim.simulator import simulate
from lab.sim.synth import builtin_trace, scaled, training_traces


def main(argv: list[str]) -> None:
    scale, which = int(argv[0]), argv[1]
    settings = [json.loads(s) for s in argv[2:]]
    if which.startswith("eval:"):
        base = [builtin_trace(name) for name in which.removeprefix("eval:").split(",")]
    else:
        shapes = set(which.split(","))
        base = [
            t
            for t in training_traces(duration_s=1800.0, variants=1)
            if t.name.rsplit("_", 1)[0].removeprefix("train_") in shapes
        ]
    for trace in base:
        t = trace if scale == 1 else scaled(trace, scale)
        for setting in settings:
            params = dict(setting)
            policy = params.pop("policy", "turboserve_staffing")
            t0 = time.time()
            r = simulate(t, policy, **params)
            row = {
                "trace": t.name,
                **setting,
                "gpu_h": round(r.cost_gpu_seconds / 3600, 3),
                "att": round(r.stall_adjusted_attainment, 5),
                "ev": r.scale_events,
                "late": r.late,
                "missed": r.missed_periods,
                "at_start": r.missed_periods_at_start,
                "reduced_pct": round(r.reduced_pct, 3),
                "wall": round(time.time() - t0, 1),
            }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
