import json, sys, time
from lab.sim.synth import training_traces, scaled
from lab.sim.simulator import simulate
scale = int(sys.argv[1]); shapes = sys.argv[2].split(","); settings = [json.loads(s) for s in sys.argv[3:]]
base = [t for t in training_traces(duration_s=1800.0, variants=1) if t.name.rsplit("_",1)[0].removeprefix("train_") in shapes]
for tr in base:
    t = tr if scale == 1 else scaled(tr, scale)
    for p in settings:
        t0 = time.time()
        q = dict(p); pol = q.pop("policy", "turboserve_staffing")
        r = simulate(t, pol, **q)
        print(json.dumps({"trace": t.name, **p, "gpu_h": round(r.cost_gpu_seconds/3600, 3), "att": round(r.stall_adjusted_attainment, 5),
              "ev": r.scale_events, "late": r.late, "missed": r.missed_periods, "at_start": r.missed_periods_at_start, "wall": round(time.time()-t0,1)}), flush=True)
