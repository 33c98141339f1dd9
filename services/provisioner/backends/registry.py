"""The backends by name; ``TURBOSERVE_BACKEND`` picks one.

- ``local``: ``turboserve worker`` processes on this host, one per GPU (``local.py``).
- ``kubernetes``: one pod per worker, created and deleted by name (``k8s.py``).

The backends build on ``base.py`` and never import this module, so adding one is a line here.
"""

from __future__ import annotations

from collections.abc import Callable

from services.provisioner.backends.base import Backend
from services.provisioner.backends.k8s import KubernetesBackend
from services.provisioner.backends.local import LocalBackend
from shared.settings import ProvisionerSettings

_MAKERS: dict[str, Callable[[ProvisionerSettings], Backend]] = {
    "local": LocalBackend,
    "kubernetes": KubernetesBackend,
}
BACKENDS = tuple(_MAKERS)


def make_backend(settings: ProvisionerSettings) -> Backend:
    maker = _MAKERS.get(settings.backend)
    if maker is None:
        raise ValueError(f"unknown backend {settings.backend!r}: one of {', '.join(BACKENDS)}")
    return maker(settings)
