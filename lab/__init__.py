"""The lab: what runs offline, apart from the services. The traces and the discrete-event
simulator that drives the policy core (``lab.sim``, ``turboserve sim``), and the evaluation
(``lab.eval``: oracles, offline-only rivals, matched comparisons, ``sim evaluate`` and ``sim
tables``). The lab imports the scheduler's core and ``shared``; no service imports the lab."""
