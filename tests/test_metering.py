"""A tenant's listings take turns, and one whose key owes is refused when its turn comes
(``server/metering.py``); the live attack is in ``test_trust_server.py``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from sandlot.errors import RateLimited
from sandlot.server.limits import RateLimiter
from sandlot.server.metering import LISTINGS_PER_TENANT, ListingTurns, Meter, charge_entries


def _scope(limiter: RateLimiter, key_id: str) -> dict[str, Any]:
    return {"state": {"meter": Meter(limiter, key_id)}}


def test_a_tenants_listings_are_made_a_few_at_once_and_another_tenants_do_not_wait() -> None:
    async def main() -> None:
        turns, limiter = ListingTurns(), RateLimiter(1000, 1000)
        inside: dict[str, int] = {"acme": 0, "globex": 0}
        most: dict[str, int] = {"acme": 0, "globex": 0}
        release = asyncio.Event()

        async def listing(tenant: str) -> None:
            async with turns.turn(_scope(limiter, tenant), tenant):
                inside[tenant] += 1
                most[tenant] = max(most[tenant], inside[tenant])
                if tenant == "acme":
                    await release.wait()
                inside[tenant] -= 1

        held = [asyncio.create_task(listing("acme")) for _ in range(10)]
        await asyncio.sleep(0.05)
        assert inside["acme"] == LISTINGS_PER_TENANT and turns.waiting("acme") == 10
        # acme's turns are all taken and eight wait: globex's listing is made at once
        await asyncio.wait_for(listing("globex"), 1)
        release.set()
        await asyncio.gather(*held)
        assert most == {"acme": LISTINGS_PER_TENANT, "globex": 1}
        assert turns.waiting("acme") == 0 and not turns._tenants  # nothing kept per tenant

    asyncio.run(main())


def test_a_listing_whose_key_owes_when_its_turn_comes_is_refused_before_it_is_made() -> None:
    """A key's listings are charged by their entries as soon as they are known, so the ones
    waiting behind see the debt; before, 100 sent at once on a key's burst were all made."""

    async def main() -> None:
        turns, limiter = ListingTurns(per_tenant=1), RateLimiter(0.01, 20)
        made: list[int] = []

        async def listing(n: int, *, refuse: bool = True) -> None:
            scope = _scope(limiter, "k")
            if refuse:
                limiter.check("k")  # its admission, as the guard takes it
            async with turns.turn(scope, "acme", refuse=refuse):
                await asyncio.sleep(0.01)
                made.append(n)
                charge_entries(scope, 2560)  # ten requests' worth

        results = await asyncio.gather(*(listing(n) for n in range(6)), return_exceptions=True)
        refused = [r for r in results if isinstance(r, RateLimited)]
        # 20 - 6 admissions = 14: the first charged 10, the second 10 more (debt -6)
        assert made == [0, 1] and len(refused) == 4, results
        assert refused[0].retry_after_s == pytest.approx(600, rel=0.01)
        # one that comes with work done (seed 001's execute, admitted before the debt) is
        # made in debt all the same
        await listing(6, refuse=False)
        assert made == [0, 1, 6]

    asyncio.run(main())


def test_a_listings_early_charge_is_not_taken_again_at_the_end() -> None:
    limiter = RateLimiter(0.01, 100)
    scope = _scope(limiter, "k")
    meter = scope["state"]["meter"]
    charge_entries(scope, 512)  # two requests now
    meter.json_bytes = 3 * 256 * 1024  # the answer: three more at the end
    meter.charge()
    with pytest.raises(RateLimited):
        limiter.check("k", 96)
    limiter.check("k", 95)


def test_a_listing_takes_its_turn_only_once_its_guest_has_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Failed before (red team, 2026-12-06): a turn was held while the guest listed, so two
    listings of a sandbox whose guest never answered (starved by its own busy loops) held
    both of its tenant's turns, and a listing of the tenant's healthy sandbox waited 7.5
    minutes, its client gone or not. The turn now covers the host's check of the entries."""
    from sandlot.core import files
    from sandlot.requests import ListFiles

    stuck = asyncio.Event()

    async def file_op(live: Any, op: Any, payload: dict[str, Any]) -> dict[str, Any]:
        if live == "stalled":
            await stuck.wait()
        entry = {"path": "a", "name": "a", "type": "file", "size_bytes": 1, "mtime": 0.0}
        return {"entries": [{**entry, "mode": 0o644}]}

    monkeypatch.setattr(files, "file_op", file_op)

    async def main() -> None:
        turns, limiter = ListingTurns(), RateLimiter(1000, 1000)

        def listing(live: str) -> Any:
            checking = turns.checking(_scope(limiter, "k"), "acme")
            return files.list_dir(live, ListFiles(path="."), checking)  # type: ignore[arg-type]

        stalled = [asyncio.create_task(listing("stalled")) for _ in range(LISTINGS_PER_TENANT)]
        await asyncio.sleep(0.05)
        healthy = await asyncio.wait_for(listing("healthy"), 2)  # before: waited for them
        assert [entry.path for entry in healthy] == ["a"]
        stuck.set()
        assert all(len(found) == 1 for found in await asyncio.gather(*stalled))
        assert turns.waiting("acme") == 0

    asyncio.run(main())
