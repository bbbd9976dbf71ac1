"""Liveness: ping an actor's inbox (or the client endpoint) and wait for its Pong."""

from __future__ import annotations

from typing import Any

import trio
import zmq

from actors.runtime.transport import open_socket
from messages.codec import BadFrame, Decoder, encode
from messages.common import Ping, Pong


async def ping(
    endpoint: str, timeout: float = 2.0, nonce: int = 1, curve: Any = None
) -> Pong | None:
    """The actor's Pong, or None if it did not answer within ``timeout`` seconds."""
    sock = open_socket(zmq.Context.instance(), zmq.DEALER, connect=[endpoint], curve=curve)
    decoder: Decoder[Pong] = Decoder(Pong)
    try:
        with trio.move_on_after(timeout):
            await sock.send([encode(Ping(nonce=nonce))])
            while True:
                frames = await sock.recv()
                try:
                    pong = decoder.decode(frames[-1])
                except BadFrame:
                    continue
                if pong.nonce == nonce:
                    return pong
        return None
    finally:
        sock.close()


async def wait_ready(
    endpoint: str, deadline: float, interval: float = 0.2, curve: Any = None
) -> Pong:
    """Ping until the actor answers ready; raises TimeoutError after ``deadline`` seconds."""
    with trio.move_on_after(deadline):
        while True:
            pong = await ping(endpoint, timeout=interval * 5, curve=curve)
            if pong is not None and pong.ready:
                return pong
            await trio.sleep(interval)
    raise TimeoutError(f"{endpoint} did not answer a ping within {deadline:.0f}s")
