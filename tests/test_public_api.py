"""The package's public surface and its error contract."""

from __future__ import annotations

import inspect

import sandlot
from sandlot import errors


def test_all_lists_every_public_name() -> None:
    public = {
        name
        for name, value in vars(sandlot).items()
        if not name.startswith("_") and not inspect.ismodule(value)
    }
    assert public <= set(sandlot.__all__) | {"annotations"}
    for name in sandlot.__all__:
        assert hasattr(sandlot, name), name


def test_every_error_derives_from_one_root_and_a_builtin() -> None:
    classes = [
        value
        for value in vars(errors).values()
        if inspect.isclass(value) and issubclass(value, Exception)
    ]
    for cls in classes:
        assert issubclass(cls, errors.SandboxError)
        if cls is not errors.SandboxError:
            builtin_bases = [b for b in cls.__mro__ if b.__module__ == "builtins"]
            assert len(builtin_bases) > 2, f"{cls.__name__} should also inherit a built-in"


def test_codes_are_unique_and_map_back() -> None:
    classes = [
        v
        for v in vars(errors).values()
        if inspect.isclass(v) and issubclass(v, errors.SandboxError)
    ]
    codes = [cls.code for cls in classes]
    assert len(codes) == len(set(codes))
    for cls in classes:
        assert type(errors.error_from_code(cls.code, "m")) is cls


def test_unknown_wire_code_never_imports_anything() -> None:
    error = errors.error_from_code("os.system", "m")
    assert type(error) is errors.SandboxError
    assert error.message == "m"


def test_host_and_guest_agree_on_the_launcher() -> None:
    import re

    from sandlot.guest import GUEST_SCRIPT, LAUNCHER

    match = re.search(r'^LAUNCHER = "(.*)"$', GUEST_SCRIPT.read_text(), re.M)
    assert match is not None and match.group(1) == LAUNCHER
