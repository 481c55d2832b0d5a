"""Registry of backends by name, imported lazily so optional dependencies stay optional.

A backend is a package (or module) here holding a class that meets :class:`Backend`, plus
one row of :data:`KNOWN_BACKENDS`; ``sandlot doctor`` and the test suite find it through
this registry. Shared by several backends: :mod:`.base` (the contract), :mod:`.launch` (how
the guest is started), :mod:`.cgroups` and :mod:`.disk`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from sandlot.backends.base import Backend, Check, Guest, GuestProcess, GuestSpec
from sandlot.config import Settings
from sandlot.errors import BackendUnavailable, ConfigError


@dataclass(frozen=True)
class BackendEntry:
    target: str  # "module:Class"
    install_hint: str  # what to install if the module cannot be imported
    # Embedded: needs no daemon or extra, so it is in every test run (skipped, with the
    # reason, where the host lacks it) and doctor holds the host to its checks. The others
    # are opt-in: tests run them when TEST_BACKENDS names them, doctor reports them.
    embedded: bool
    isolating: bool  # walls between sandbox and host (limits, escape tests apply)


KNOWN_BACKENDS: dict[str, BackendEntry] = {
    "bubblewrap": BackendEntry(
        "sandlot.backends.bubblewrap.backend:BubblewrapBackend",
        "apt-get install -y bubblewrap util-linux e2fsprogs",
        embedded=True,
        isolating=True,
    ),
    "docker": BackendEntry(
        "sandlot.backends.docker.backend:DockerBackend",
        "pip install 'sandlot[docker]' and apt-get install -y docker.io",
        embedded=False,
        isolating=True,
    ),
    "unsafe-local": BackendEntry(
        "sandlot.backends.local:LocalBackend", "", embedded=True, isolating=False
    ),
}


def _entry(name: str) -> BackendEntry:
    try:
        return KNOWN_BACKENDS[name]
    except KeyError:
        known = ", ".join(sorted(KNOWN_BACKENDS))
        raise ConfigError(f"unknown backend {name!r}; choose one of: {known}") from None


def backend_class(name: str) -> type[Backend]:
    """The class of the backend called ``name``, imported now.

    Raises:
        ConfigError: no backend has that name.
        BackendUnavailable: its module or a dependency is missing.
    """
    entry = _entry(name)
    module_name, _, class_name = entry.target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailable(
            f"backend {name!r} cannot be imported ({exc}); {entry.install_hint}"
        ) from exc
    cls: type[Backend] = getattr(module, class_name)
    return cls


def create_backend(name: str, settings: Settings) -> Backend:
    """Instantiate the backend called ``name``.

    Raises:
        ConfigError: no backend has that name.
        BackendUnavailable: its module or a dependency is missing.
    """
    return backend_class(name)(settings)


def probe_backend(name: str, settings: Settings, runtime: str | None = None) -> list[Check]:
    """Whether this host can run backend ``name`` (on ``runtime``), as its checks; a backend
    that cannot even be imported is one failed check.

    Raises:
        ConfigError: no backend has that name.
    """
    try:
        cls = backend_class(name)
    except BackendUnavailable as exc:
        return [Check(name, False, exc.message, "the backend's code and dependencies")]
    return cls.probe(settings, runtime)


__all__ = [
    "KNOWN_BACKENDS",
    "Backend",
    "BackendEntry",
    "Check",
    "Guest",
    "GuestProcess",
    "GuestSpec",
    "backend_class",
    "create_backend",
    "probe_backend",
]
