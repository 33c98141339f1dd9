"""The ways of getting a GPU worker: ``base.py`` the contract, ``local.py`` and ``k8s.py`` the
backends, ``registry.py`` the one that picks a backend by name (``TURBOSERVE_BACKEND``)."""
