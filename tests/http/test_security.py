"""Security defaults: loopback unless told otherwise; CURVE keeps out clients without the key."""

from __future__ import annotations

import socket

import pytest
import trio
import zmq

from actors.runtime.config import RuntimeConfig
from actors.runtime.security import InsecureBind, check_bind, make_keys
from actors.runtime.transport import open_socket
from minirt.client import open_client
from tests.support.runtime import start_runtime


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_default_endpoints_are_ipc_under_the_run_dir(tmp_path):
    cfg = RuntimeConfig(run_dir=str(tmp_path)).resolve()
    for name in ("client", "tokenizer", "scheduler", "kv_manager", "executor"):
        assert cfg.endpoints.of(name).startswith(f"ipc://{tmp_path}")


def test_non_loopback_bind_needs_allow_remote_and_curve(tmp_path):
    check_bind("tcp://127.0.0.1:5555", allow_remote=False, curve=False)
    check_bind("ipc:///tmp/x", allow_remote=False, curve=False)
    for addr in ("tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.1.2.3:5555"):
        with pytest.raises(InsecureBind, match="allow-remote"):
            check_bind(addr, allow_remote=False, curve=True)
        with pytest.raises(InsecureBind, match="CURVE"):
            check_bind(addr, allow_remote=True, curve=False)
        check_bind(addr, allow_remote=True, curve=True)
    ctx = zmq.Context.instance()
    with pytest.raises(InsecureBind):
        open_socket(ctx, zmq.ROUTER, bind="tcp://0.0.0.0:0")


@pytest.mark.deadline(180)
async def test_curve_client_with_key_is_served_and_without_is_not(tiny_model, tmp_path):
    keys = tmp_path / "keys"
    make_keys(keys, ("client",))
    stranger = tmp_path / "stranger"
    make_keys(stranger, ("client",))  # a valid key pair, but for another server: not authorized
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    flags = ("--curve-dir", str(keys), "--client-endpoint", endpoint)
    with start_runtime(tiny_model, tmp_path / "rt", *flags) as rt:
        assert rt.endpoint == endpoint
        async with open_client(endpoint, curve_dir=str(keys)) as client:
            res = await client.generate(prompt_ids=[4, 5, 6], max_tokens=3)
            assert len(res.token_ids) == 3
        for who in (None, str(stranger)):
            with trio.move_on_after(3) as timeout:  # CURVE drops the handshake: no answer at all
                async with open_client(endpoint, curve_dir=who) as client:
                    await client.generate(prompt_ids=[4, 5, 6], max_tokens=3)
            assert timeout.cancelled_caught, f"{who or 'no key'} was served"
        received = rt.events("client.received")
        assert len(received) == 1  # only the authorized client's request got in


def test_no_pickle_in_the_product():
    """Every frame is msgpack into typed structs; nothing in the product can unpickle."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    offenders = [
        str(p.relative_to(root))
        for pkg in ("actors", "messages", "gpu", "tokenizer_svc")
        for p in (root / pkg).rglob("*.py")
        if any(
            w in p.read_text() for w in ("import pickle", "from pickle", "recv_pyobj", "send_pyobj")
        )
    ]
    assert offenders == []
