"""Waiting for a router the bench started: until its ``/health`` says every worker it
knows is healthy, for the benches that drive a router over worker processes."""

from __future__ import annotations

import asyncio
import time

import httpx


async def wait_healthy(base: str, timeout: float = 120) -> None:
    """Returns once the router at ``base`` answers ``/health`` with every worker healthy;
    exits the bench, saying so, if that takes longer than ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5) as c:
        while time.monotonic() < deadline:
            try:
                r = await c.get(f"{base}/health")
                if r.status_code == 200 and all(w["healthy"] for w in r.json()["workers"]):
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    raise SystemExit(f"the router at {base} did not become healthy in {timeout:g} s")
