"""Admission: whether a new sandbox may start, given what its owner already holds.

Checked with no await between the check and the sandbox's registration, so concurrent creates
of one owner cannot both slip under a quota.
"""

from __future__ import annotations

from collections.abc import Iterable

from sandlot.errors import QuotaExceeded
from sandlot.models import Quota, ResolvedLimits, SandboxInfo


def check_quota(
    live: Iterable[SandboxInfo], owner: str, limits: ResolvedLimits, quota: Quota
) -> None:
    """Raise if ``owner`` cannot start one more sandbox of ``limits`` within ``quota``.

    Raises:
        QuotaExceeded: the owner's live sandboxes, with this one, would be over the quota
            (the message names the setting that raises it).
    """
    mine = [info for info in live if info.owner == owner]
    if len(mine) >= quota.max_sandboxes:
        raise QuotaExceeded(
            f"{owner!r} has {len(mine)} live sandboxes, its quota is {quota.max_sandboxes}; "
            "destroy one, or raise TENANT_MAX_SANDBOXES"
        )
    used_mb = sum(info.limits.memory_mb for info in mine)
    if used_mb + limits.memory_mb > quota.max_memory_mb:
        raise QuotaExceeded(
            f"{owner!r} uses {used_mb} MiB in live sandboxes; {limits.memory_mb} MiB more is "
            f"over its quota of {quota.max_memory_mb} MiB; use a smaller memory_mb, destroy a "
            "sandbox, or raise TENANT_MAX_MEMORY_MB"
        )
