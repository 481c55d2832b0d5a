"""Placement: which backend, OCI runtime and environment a sandbox runs on, checked together.

The same resolution serves a create request and the warm pools' settings, so a pool holds
exactly what an equivalent create would start.
"""

from __future__ import annotations

from collections.abc import Callable

from sandlot.backends import KNOWN_BACKENDS, Backend
from sandlot.config import Settings
from sandlot.core.live import PoolKey
from sandlot.core.pools import MAX_POOL_SIZE
from sandlot.environments import HOST_ENVIRONMENT, get_environment
from sandlot.errors import ConfigError


def resolve(
    settings: Settings,
    backend_of: Callable[[str], Backend],
    backend: str | None,
    runtime: str | None,
    environment: str | None,
) -> PoolKey:
    """Check the backend, runtime and environment go together; name them canonically.

    Raises:
        ConfigError: an unknown name, a combination the backend cannot run, or a backend
            without isolation while SANDBOX_ALLOW_UNSAFE is off.
    """
    backend = backend or settings.backend
    entry = KNOWN_BACKENDS.get(backend)
    if entry is not None and not entry.isolating and not settings.allow_unsafe:
        raise ConfigError(
            f"backend {backend!r} has no isolation and runs code as this process's "
            "user; it is refused unless SANDBOX_ALLOW_UNSAFE=true (tests, development)"
        )
    chosen = backend_of(backend)
    if runtime is not None and runtime not in chosen.runtimes:
        choice = ", ".join(sorted(chosen.runtimes)) or "none (only docker has runtimes)"
        raise ConfigError(f"backend {backend!r} has no runtime {runtime!r}; its runtimes: {choice}")
    if runtime is None and chosen.runtimes:
        runtime = settings.docker_runtime
        if runtime not in chosen.runtimes:
            raise ConfigError(
                f"SANDBOX_DOCKER_RUNTIME={runtime!r} is not one of "
                f"{', '.join(sorted(chosen.runtimes))}"
            )
    env = get_environment(environment or settings.environment, settings.registry_dir)
    if not chosen.any_environment and env.name != HOST_ENVIRONMENT:
        raise ConfigError(
            f"environment {env.name!r} needs its own root file system, which backend "
            f"{backend!r} cannot use (it runs the host's {HOST_ENVIRONMENT}); use "
            "backend='bubblewrap' or 'docker'"
        )
    return PoolKey(backend, runtime, env.name)


def pool_targets(settings: Settings, backend_of: Callable[[str], Backend]) -> dict[PoolKey, int]:
    """Warm pool sizes: SANDBOX_POOL_SIZE for the defaults, SANDBOX_POOLS for the rest.

    Raises:
        ConfigError: a SANDBOX_POOLS key that names no backend, runtime or environment.
    """
    targets: dict[PoolKey, int] = {}
    if settings.pool_size > 0:
        targets[resolve(settings, backend_of, None, None, None)] = settings.pool_size
    for text, size in settings.pools.items():
        head, _, environment = text.partition(":")
        backend, _, runtime = head.partition("+")
        if not 0 <= size <= MAX_POOL_SIZE:
            raise ConfigError(f"SANDBOX_POOLS[{text!r}]={size}: sizes go from 0 to 64")
        try:
            key = resolve(settings, backend_of, backend, runtime or None, environment or None)
        except ConfigError as exc:
            raise ConfigError(f"SANDBOX_POOLS[{text!r}]: {exc.message}") from None
        if size:
            targets[key] = size
    return targets
