"""Fan-out of the engine's prefix-cache events to every Events subscriber."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from splitserve.v1 import worker_pb2 as pb

log = logging.getLogger(__name__)

POLL_S = 0.1
QUEUE_LIMIT = 10_000
"""Events kept per slow subscriber; past this it is dropped (it re-subscribes)."""

_KINDS = {"stored": pb.KVEvent.STORED, "evicted": pb.KVEvent.EVICTED}


class EventHub:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._subs: set[asyncio.Queue[pb.KVEvent | None]] = set()
        self._seq = 0

    async def poll_forever(self) -> None:
        while True:
            try:
                events = await self.engine.call(self.engine.engine.drain_events)
            except Exception:  # the engine stopped: nothing more will come
                log.exception("draining prefix-cache events")
                events = []
            for ev in events:
                self._seq += 1
                msg = pb.KVEvent(
                    kind=_KINDS.get(str(ev.kind), pb.KVEvent.KIND_UNSPECIFIED),
                    block_hashes=[h & 0xFFFFFFFFFFFFFFFF for h in ev.block_hashes],
                    seq=self._seq,
                )
                for q in list(self._subs):
                    if q.qsize() >= QUEUE_LIMIT:
                        self._subs.discard(q)
                        with contextlib.suppress(asyncio.QueueFull):
                            q.put_nowait(None)
                    else:
                        q.put_nowait(msg)
            await asyncio.sleep(POLL_S)

    @property
    def subscribers(self) -> int:
        """Events streams open now: each gets every event drained from here on."""
        return len(self._subs)

    async def subscribe(self) -> AsyncIterator[pb.KVEvent]:
        q: asyncio.Queue[pb.KVEvent | None] = asyncio.Queue()
        self._subs.add(q)
        try:
            while True:
                msg = await q.get()
                if msg is None:
                    return
                yield msg
        finally:
            self._subs.discard(q)
