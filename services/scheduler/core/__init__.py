"""The scheduler's policy core: pure, synchronous, deterministic; no I/O beyond its own JSON.

``types`` (events and decisions), ``profile`` (latency model), ``cluster`` (the controller's
view), ``placement`` (min-max local search), ``autoscale`` (rho_hat, hysteresis, volatility),
``loop`` (the closed-loop ``Controller``) and ``policies`` (the registry of policies by name).
See docs/scheduler.md.
"""
