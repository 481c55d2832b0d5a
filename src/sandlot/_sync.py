"""Blocking twins of async classes, generated from them: the SDK is written once, async.

A twin class lists each member once, as ``run_code = blocking(AsyncSandbox.run_code)``; the
generated method keeps the async one's parameters, docstring and annotations
(``inspect.signature`` shows them, and through ``ParamSpec`` mypy checks every call), and runs
the coroutine on the SDK's background loop (the portal). modal's ``synchronize_api`` is the
model; two hand-kept copies of every method are what this avoids.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

from sandlot._portal import Portal, get_portal

P = ParamSpec("P")
R = TypeVar("R")
A = TypeVar("A")
T = TypeVar("T", bound="SyncTwin[Any]")


class SyncTwin(Generic[A]):
    """A blocking twin: the async object it wraps, and the portal that runs its coroutines."""

    def __init__(self, inner: A, portal: Portal) -> None:
        self._inner = inner
        self._portal = portal


def blocking(
    method: Callable[Concatenate[A, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[SyncTwin[A], P], R]:
    """The blocking twin of an async method: same parameters, same result."""

    @functools.wraps(method)
    def call(self: SyncTwin[A], /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._portal.call(method(self._inner, *args, **kwargs))

    return call


def blocking_classmethod(method: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, R]:
    """The blocking twin of an async classmethod whose result is not a new async object
    (``AsyncSandbox.list``): the same parameters, the same result."""

    @functools.wraps(method)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        return get_portal().call(method(*args, **kwargs))

    return staticmethod(call)


class constructor(Generic[P, A]):
    """The blocking twin of an async classmethod that returns a new async object.

    On the twin class it builds the twin around the async object, so
    ``Sandbox.create(...)`` returns a ``Sandbox`` where ``AsyncSandbox.create(...)`` returns an
    ``AsyncSandbox``.
    """

    def __init__(self, method: Callable[P, Coroutine[Any, Any, A]]) -> None:
        self._method = method

    @overload
    def __get__(self, instance: None, owner: type[T]) -> Callable[P, T]: ...
    @overload
    def __get__(self, instance: T, owner: type[T]) -> Callable[P, T]: ...
    def __get__(self, instance: object, owner: type[T]) -> Callable[P, T]:
        method = self._method

        @functools.wraps(method)
        def call(*args: P.args, **kwargs: P.kwargs) -> T:
            portal = get_portal()
            return owner(portal.call(method(*args, **kwargs)), portal)

        signature = inspect.signature(method)
        call.__signature__ = signature.replace(  # type: ignore[attr-defined]
            return_annotation=owner.__name__
        )
        return call


def twin_of(twin: type[Any], original: type[Any]) -> list[str]:
    """The public coroutine methods of ``original`` that ``twin`` lacks (a test asks for [])."""
    missing = []
    for name, member in inspect.getmembers(original):
        if name.startswith("_") or not inspect.iscoroutinefunction(member):
            continue
        if not callable(getattr(twin, name, None)):
            missing.append(name)
    return missing
