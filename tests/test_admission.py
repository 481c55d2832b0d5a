"""Admission (issue 11): quotas cover every resource a sandbox reserves, and the host's
capacity bounds the sum, whoever asks. On the in-process backend: admission is the
manager's, whatever isolates the sandboxes."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandlot import SandboxManager
from sandlot.errors import CapacityExhausted, ConfigError, QuotaExceeded
from sandlot.models import Quota
from sandlot.requests import SandboxSpec
from tests.conftest import make_settings

QUOTA = Quota(
    max_sandboxes=10,
    max_memory_mb=4096,
    max_pids=1000,
    max_cpu_cores=1.0,
    max_disk_mb=200,
)


@pytest.fixture
def data_dir(data_root: Path, request: pytest.FixtureRequest) -> Path:
    path = data_root / f"admission-{request.node.name}"
    path.mkdir()
    return path


@pytest.mark.parametrize(
    ("first", "second", "setting"),
    [
        ({"pids": 600}, {"pids": 600}, "TENANT_MAX_PIDS"),
        ({"cpu_cores": 0.75}, {"cpu_cores": 0.5}, "TENANT_MAX_CPU_CORES"),
        ({"disk_mb": 150}, {"disk_mb": 64}, "TENANT_MAX_DISK_MB"),
    ],
)
async def test_a_tenant_quota_bounds_every_reserved_resource(
    data_dir: Path, first: dict[str, float], second: dict[str, float], setting: str
) -> None:
    async with SandboxManager(make_settings(data_dir, backend="unsafe-local")) as mgr:
        await mgr.create(SandboxSpec.model_validate(first), owner="acme", quota=QUOTA)
        with pytest.raises(QuotaExceeded, match=setting):
            await mgr.create(SandboxSpec.model_validate(second), owner="acme", quota=QUOTA)
        # Another tenant is not affected by acme's holdings.
        await mgr.create(SandboxSpec.model_validate(second), owner="globex", quota=QUOTA)


@pytest.mark.parametrize(
    ("override", "spec", "setting"),
    [
        ({"host_memory_overcommit": 0.001}, {"memory_mb": 64}, "SANDBOX_HOST_MEMORY_OVERCOMMIT"),
        ({"host_pids_fraction": 0.000001}, {"pids": 64}, "SANDBOX_HOST_PIDS_FRACTION"),
        ({"max_disk_mb": 1_048_576}, {"disk_mb": 1_048_576}, "SANDBOX_HOST_DISK_FRACTION"),
    ],
)
async def test_the_host_refuses_what_it_cannot_hold(
    data_dir: Path, override: dict[str, float], spec: dict[str, int], setting: str
) -> None:
    settings = make_settings(data_dir, backend="unsafe-local", **override)
    async with SandboxManager(settings) as mgr:
        with pytest.raises(CapacityExhausted, match=setting):
            await mgr.create(SandboxSpec.model_validate(spec))
        assert mgr.live_count() == 0


async def test_host_capacity_counts_every_tenant_and_frees_on_destroy(data_dir: Path) -> None:
    # CPU: 0.5 per sandbox; the host may hold as many as its cores times the factor.
    import os

    cores = os.cpu_count() or 1
    settings = make_settings(data_dir, backend="unsafe-local", host_cpu_overcommit=1.0 / cores)
    async with SandboxManager(settings) as mgr:  # capacity: 1 core in all
        a = await mgr.create(SandboxSpec(cpu_cores=0.5), owner="a")
        await mgr.create(SandboxSpec(cpu_cores=0.5), owner="b")
        with pytest.raises(CapacityExhausted, match="SANDBOX_HOST_CPU_OVERCOMMIT"):
            await mgr.create(SandboxSpec(cpu_cores=0.5), owner="c")
        await mgr.destroy(a.id)
        await mgr.create(SandboxSpec(cpu_cores=0.5), owner="c")


async def test_metadata_is_bounded(data_dir: Path) -> None:
    settings = make_settings(data_dir, backend="unsafe-local", max_metadata_bytes=1024)
    async with SandboxManager(settings) as mgr:
        with pytest.raises(ConfigError, match="SANDBOX_MAX_METADATA_BYTES"):
            await mgr.create(SandboxSpec(metadata={"k": "v" * 2000}))
        await mgr.create(SandboxSpec(metadata={"k": "v" * 500}))
