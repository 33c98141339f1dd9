"""The evaluation: oracles (the floor, the clairvoyant controller, exhaustive placement),
matched comparisons on cost-latency curves, ablations, sensitivity sweeps, plots and the
report behind ``turboserve sim evaluate``. See docs/evaluation.md."""
