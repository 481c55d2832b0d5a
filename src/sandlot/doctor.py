"""``sandlot doctor``: which isolation features this host has, and why each matters.

Each backend says what it needs (its ``probe``, found through :mod:`sandlot.backends`); this
module only gathers the answers, and adds the agent layer's local model.
"""

from __future__ import annotations

from dataclasses import replace

from sandlot.backends import KNOWN_BACKENDS, Check, probe_backend
from sandlot.config import get_settings
from sandlot.core import admission
from sandlot.errors import SandboxError


def run_checks(*, optional: bool = False) -> list[Check]:
    """What every embedded backend needs from this host; with ``optional``, also what the
    opt-in backends (docker: daemon, gVisor, images) and the agent's local model need, all
    reported as optional (slower: it asks dockerd and loads llama.cpp)."""
    settings = get_settings()
    checks: list[Check] = []
    for name, entry in KNOWN_BACKENDS.items():
        if entry.embedded:
            checks += probe_backend(name, settings)
        elif optional:
            checks += [replace(c, required=False) for c in probe_backend(name, settings)]
    checks.append(open_files_check())
    if optional:
        checks += _agent_checks()
    return checks


# Sandboxes one process should be able to hold before its open-file limit is what stops it.
WANTED_SANDBOXES = 1000


def open_files_check() -> Check:
    """How many sandboxes this process's open-file limit allows, once the manager has raised
    its soft limit to the hard one (what it does at start)."""
    soft, hard = admission.nofile_limits()
    used = admission.open_fds()
    allowed = admission.sandboxes_allowed(hard, used)
    per_backend = ", ".join(f"{name} {n}" for name, n in admission.FDS_PER_SANDBOX.items())
    detail = (
        f"soft {soft}, hard {hard}: about {allowed} sandboxes in one process, at up to "
        f"{max(admission.FDS_PER_SANDBOX.values())} file descriptors each ({per_backend}); "
        f"the manager raises the soft limit to the hard one at start"
    )
    if allowed < WANTED_SANDBOXES:
        detail += f"; for {WANTED_SANDBOXES}, raise {admission.how_to_raise(hard, hard)}"
    why = "each live sandbox holds a few of the manager's file descriptors (RLIMIT_NOFILE)"
    return Check("open files", allowed >= WANTED_SANDBOXES, detail, why, required=False)


def _agent_checks() -> list[Check]:
    """The optional agent layer's local model: llama.cpp and the fetched weights."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return [
            Check(
                "local model",
                False,
                "llama-cpp-python missing: pip install 'sandlot[local]'",
                LOCAL_WHY,
                required=False,
            )
        ]
    from sandlot.agent.config import get_agent_settings
    from sandlot.agent.weights import is_fetched, model_path

    settings = get_agent_settings()
    if settings.local_model_path is not None:
        ok = settings.local_model_path.is_file()
        return [Check("local model", ok, str(settings.local_model_path), LOCAL_WHY, False)]
    name = settings.local_model
    try:
        fetched = is_fetched(name, settings.models_dir)
        detail = (
            str(model_path(name, settings.models_dir))
            if fetched
            else (f"{name} not fetched: make models")
        )
    except SandboxError as exc:
        fetched, detail = False, str(exc)
    return [Check("local model", fetched, detail, LOCAL_WHY, required=False)]


LOCAL_WHY = "LLM_PROVIDER=local: the agent writes code with no network and no key"
