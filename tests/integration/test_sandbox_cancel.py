"""A cancelled exec stops its command even when the cancel lands before the command has joined
the sandbox's cgroup (the launcher joins it itself, a moment after it is spawned).

On a loaded machine that moment is long enough to be hit: a cancelled `sleep 600` then ran to
its end. Here the moment is stretched on purpose: the launcher waits before it joins.
"""
from __future__ import annotations

import asyncio
import uuid

from kiln.services.sandbox.bubblewrap import BubblewrapSandbox
from kiln.services.sandbox.config import BubblewrapConfig, SandboxLimits
from kiln.services.sandbox.factory import leftovers, reap_orphans

JOIN_DELAY_S = 3


class LateJoiningSandbox(BubblewrapSandbox):
    """The real sandbox, whose launcher sleeps before it joins the cgroup."""

    def _argv(self, *args, **kwargs) -> list[str]:
        return ["/bin/sh", "-c", f'sleep {JOIN_DELAY_S}; exec "$@"', "late",
                *super()._argv(*args, **kwargs)]


def test_a_cancel_before_the_command_joins_the_cgroup_still_stops_it() -> None:
    config = BubblewrapConfig(owner=f"c{uuid.uuid4().hex[:8]}",
                              limits=SandboxLimits(memory_bytes="128m", pids=64))

    async def go() -> None:
        sb = LateJoiningSandbox(config)
        await sb.start()
        try:
            task = asyncio.ensure_future(sb.exec("sleep 600"))
            await asyncio.sleep(0.5)  # spawned, still before the join
            assert not task.done()
            task.cancel()
            # Generous against load; the command itself would take 600 s.
            done, _ = await asyncio.wait([task], timeout=120)
            assert done, "the cancelled exec still runs its command"
            assert sb.cgroup.pids() == []
        finally:
            await sb.destroy()

    try:
        asyncio.run(go())
    finally:
        reap_orphans(config)
    assert leftovers(config) == []
