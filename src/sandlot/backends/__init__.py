"""Registry of backends by name, imported lazily so optional dependencies stay optional."""

from __future__ import annotations

import importlib

from sandlot.backends.base import Backend, Guest, GuestProcess, GuestSpec
from sandlot.config import Settings
from sandlot.errors import BackendUnavailable, ConfigError

# name -> ("module:Class", what to install if the import fails)
KNOWN_BACKENDS: dict[str, tuple[str, str]] = {
    "bubblewrap": (
        "sandlot.backends.bubblewrap:BubblewrapBackend",
        "apt-get install -y bubblewrap util-linux e2fsprogs",
    ),
    "docker": (
        "sandlot.backends.docker:DockerBackend",
        "pip install 'sandlot[docker]' and apt-get install -y docker.io",
    ),
    "unsafe-local": ("sandlot.backends.local:LocalBackend", ""),
}


def create_backend(name: str, settings: Settings) -> Backend:
    """Instantiate the backend called ``name``.

    Raises:
        ConfigError: no backend has that name.
        BackendUnavailable: its module or a dependency is missing.
    """
    try:
        target, hint = KNOWN_BACKENDS[name]
    except KeyError:
        known = ", ".join(sorted(KNOWN_BACKENDS))
        raise ConfigError(f"unknown backend {name!r}; choose one of: {known}") from None
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailable(f"backend {name!r} cannot be imported ({exc}); {hint}") from exc
    backend: Backend = getattr(module, class_name)(settings)
    return backend


__all__ = ["KNOWN_BACKENDS", "Backend", "Guest", "GuestProcess", "GuestSpec", "create_backend"]
