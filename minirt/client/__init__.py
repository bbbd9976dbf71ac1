"""Python client for minirt (sync and trio async). The CLI uses it; so can you.

async with open_client("ipc://.minirt/sock/client") as c:
    result = await c.generate(prompt="hello", max_tokens=16)
    async for delta in c.stream(prompt="hello"): ...

with SyncClient(endpoint) as c:
    for msg in c.stream(prompt="hello"): ...

Both resume a stream whose connection to the front door is lost (it restarted) unless created
with ``resume=False``: they resubmit the request with the tokens already received.
"""

from minirt.client.aio import AsyncClient, connect, open_client
from minirt.client.core import (
    READY_POLL_S,
    READY_TIMEOUT_S,
    ConnectionLost,
    RequestError,
    Result,
    ServerWatch,
    build_generate,
)
from minirt.client.sync import SyncClient

__all__ = [
    "READY_POLL_S",
    "READY_TIMEOUT_S",
    "AsyncClient",
    "ConnectionLost",
    "RequestError",
    "Result",
    "ServerWatch",
    "SyncClient",
    "build_generate",
    "connect",
    "open_client",
]
