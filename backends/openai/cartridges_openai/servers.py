"""Several servers behind one synthesizer: requests go to the least busy server that is up, and a server that fails
is left out for a while (then tried again, so a restarted server rejoins)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import attrs

from .options import shown

log = logging.getLogger("cartridges_openai")


@attrs.define(eq=False)
class Server:
    url: str
    client: Any  # openai.AsyncOpenAI, with its own retries off
    slots: asyncio.Semaphore
    name: str = ""  # the URL as messages show it (no user:password)
    assigned: int = 0  # requests given to it and not finished (waiting for a slot or in flight)
    down_until: float = 0.0
    failing: bool = False  # failed since it last answered (said once, not per request)
    failed_at: float = float("-inf")  # when it last failed: an answer to a request sent before says nothing of now
    verified: bool = False  # answered the same-model probe since it last went down
    verifying: asyncio.Lock = attrs.field(factory=asyncio.Lock)  # one probe at a time
    sent: int = 0
    succeeded: int = 0
    failed: int = 0


class ServerPool:
    def __init__(self, urls: Sequence[str], make_client: Callable[[str], Any], concurrency: int, cooldown: float,
                 clock: Callable[[], float] = time.monotonic):
        self.servers = [Server(u, make_client(u), asyncio.Semaphore(concurrency), shown(u)) for u in urls]
        self.cooldown = cooldown
        self.clock = clock

    def pick(self, avoid: Server | None = None) -> Server:
        """The least busy server that is up, other than `avoid` when another is up; when none is up, the one due
        back first (the caller has already waited its backoff)."""
        now = self.clock()
        up = [s for s in self.servers if s.down_until <= now]
        if avoid is not None and len(up) > 1:
            up = [s for s in up if s is not avoid]
        if not up:
            return min(self.servers, key=lambda s: s.down_until)
        return min(up, key=lambda s: s.assigned)

    @contextlib.asynccontextmanager
    async def use(self, server: Server) -> AsyncIterator[Server]:
        server.assigned += 1
        try:
            async with server.slots:
                server.sent += 1
                yield server
        finally:
            server.assigned -= 1

    def succeeded(self, server: Server, started: float) -> None:
        """Count the answer to a request sent at `started`; only one sent after its last failure puts it back."""
        server.succeeded += 1
        if started < server.failed_at:
            return
        server.down_until = 0.0
        if server.failing:
            server.failing = False
            log.warning("%s answers again.", server.name)

    def failed(self, server: Server, error: Exception, down: bool) -> None:
        """Count a transient failure. A server that is down must answer the probe again before it is used, and
        leaves rotation for `cooldown` seconds when others remain."""
        server.failed += 1
        server.failed_at = self.clock()
        if not server.failing:
            server.failing = True
            where = f"; out of rotation for {self.cooldown:.0f} s" if down and len(self.servers) > 1 else ""
            log.warning("%s failed (%s)%s; its requests are retried.", server.name, error, where)
        if down:
            server.verified = False
            if len(self.servers) > 1:
                server.down_until = self.clock() + self.cooldown

    def stats(self) -> list[dict[str, Any]]:
        now = self.clock()
        return [{"url": s.name, "sent": s.sent, "succeeded": s.succeeded, "failed": s.failed,
                 "up": s.down_until <= now} for s in self.servers]

    async def aclose(self) -> None:
        await asyncio.gather(*(s.client.close() for s in self.servers), return_exceptions=True)
