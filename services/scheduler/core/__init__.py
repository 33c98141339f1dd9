"""The scheduler's policy core: pure, synchronous, deterministic; no I/O (it reads no files).

``types`` (events and decisions), ``config`` (``ControllerConfig``), ``profile`` (latency
model), ``cluster`` (the controller's view, GPUs of one or more kinds), ``placement`` (min-max
local search), ``autoscale`` (rho_hat, hysteresis, volatility), ``loop`` (the closed-loop
``Controller``), ``rivals`` (the live rivals' controllers), ``staffing`` (the pool sized for
the demand one boot delay ahead), ``policies`` (policies by name, and ``LIVE_POLICIES``, the
one list of those the live scheduler may run) and ``pool`` (the ``Pool``: a policy and the
books of the workers behind its GPUs, with the decisions a real pool adds, which the live
scheduler and the simulator both drive). The files it
is configured from are read by its callers (``services.scheduler.shipped``). See
docs/scheduler.md.
"""
