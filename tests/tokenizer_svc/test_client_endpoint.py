"""The front door's client endpoint without sockets: per-connection request ids, sends through the
outbox, a step's messages batched for the clients that asked, disconnects and idle probes, on
trio's mock clock."""

from __future__ import annotations

import errno

import trio
import trio.testing
import zmq

from messages import client as cm
from messages.codec import Decoder
from messages.common import Ping, Pong
from messages.tokenizer import client_request_id
from tokenizer_svc.clients import PROBE_S, ClientEndpoint


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def info(self, event: str, **fields) -> None:
        self.events.append((event, fields))


class Wire:
    """Stands in for the ROUTER: records frames per identity; ``full`` refuses (queue at its
    high-water mark), ``gone`` raises EHOSTUNREACH (the client disconnected)."""

    def __init__(self) -> None:
        self.sent: dict[bytes, list] = {}
        self.full: set[bytes] = set()
        self.gone: set[bytes] = set()
        self.decoder: Decoder = Decoder(Pong | Ping)

    def try_send(self, ident: bytes, data: bytes) -> bool:
        if ident in self.gone:
            raise zmq.ZMQError(errno.EHOSTUNREACH)
        if ident in self.full:
            return False
        self.sent.setdefault(ident, []).append(self.decoder.decode(data))
        return True


def endpoint(on_leaving=lambda: None) -> tuple[ClientEndpoint, Wire, list[list[str]], Log]:
    wire, gone, log = Wire(), [], Log()
    ep = ClientEndpoint(wire.try_send, gone.append, "boot1234", log, on_leaving)
    return ep, wire, gone, log


def test_ids_are_scoped_to_the_connection():
    ep, *_ = endpoint()
    a1 = ep.open(b"A", "1")
    b1 = ep.open(b"B", "1")
    assert a1 is not None and b1 is not None and a1 != b1  # same id, two clients: no collision
    assert client_request_id(a1) == client_request_id(b1) == "1"
    assert ep.open(b"A", "1") is None  # in flight on this connection: refused
    assert ep.lookup(b"A", "1") == a1 and ep.lookup(b"B", "1") == b1
    assert ep.lookup(b"C", "1") is None  # another client sees nothing of them
    ep.close(b"A", "1")
    assert ep.lookup(b"A", "1") is None and ep.lookup(b"B", "1") == b1
    again = ep.open(b"A", "1")
    assert again not in (None, a1, b1)  # reusable, under a fresh runtime-wide id


async def test_a_client_that_is_gone_hands_back_its_requests(autojump_clock):
    woken = []
    ep, wire, gone, log = endpoint(lambda: woken.append(True))
    ids = [ep.open(b"A", "1"), ep.open(b"A", "2")]
    ep.open(b"B", "1")
    wire.gone.add(b"A")
    ep.send(b"A", Ping(nonce=1))
    # only leaving until the reader settles: a cancel A sent before it went may still be unread,
    # and must find its request (else it would be aborted as a disconnect)
    assert woken == [True] and not gone and not log.events
    assert ep.lookup(b"A", "1") == ids[0]
    ep.send(b"A", Ping(nonce=2))  # nothing more is sent to it, and it is reported once
    ep.close(b"A", "1")  # the cancel read meanwhile ended request 1
    ep.settle()
    assert gone == [ids[1:]]  # A's request left, and only A's
    assert ep.lookup(b"A", "2") is None and ep.in_flight() == 1
    assert log.events == [("client.disconnected", {"client": "c1", "requests": 1})]
    ep.settle()
    assert gone == [ids[1:]] and woken == [True]


async def test_frames_wait_in_order_while_a_client_is_full(mock_clock):
    ep, wire, _, _ = endpoint()
    ep.open(b"A", "1")
    wire.full.add(b"A")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ep.outbox.run)
        for n in range(1, 4):
            ep.send(b"A", Ping(nonce=n))
        ep.send(b"B", Ping(nonce=9))  # another client is not held up
        assert b"A" not in wire.sent and wire.sent[b"B"] == [Ping(nonce=9)]
        mock_clock.jump(0.05)  # the flusher retries: A is still full
        await trio.testing.wait_all_tasks_blocked()
        assert b"A" not in wire.sent
        wire.full.discard(b"A")
        mock_clock.jump(0.05)
        await trio.testing.wait_all_tasks_blocked()
        assert wire.sent[b"A"] == [Ping(nonce=n) for n in (1, 2, 3)]
        nursery.cancel_scope.cancel()


async def test_idle_clients_with_requests_are_probed_and_the_others_forgotten(mock_clock):
    ep, wire, gone, _ = endpoint()
    ep.open(b"A", "1")  # waits in the queue: nothing is sent to it
    ep.open(b"B", "1")
    ep.close(b"B", "1")  # B has nothing in flight
    probe = Pong(actor="tokenizer", boot_id="boot1234")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ep.probe_loop, probe)
        await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(PROBE_S * 1.5)
        await trio.testing.wait_all_tasks_blocked()
        assert wire.sent.get(b"A") == [probe]
        assert b"B" not in ep.clients and b"B" not in wire.sent
        wire.gone.add(b"A")  # A disconnects: the next probe finds out
        mock_clock.jump(PROBE_S)
        await trio.testing.wait_all_tasks_blocked()
        ep.settle()  # (the reader, once it read what A sent)
        assert gone and gone[0][0].startswith("1@") and b"A" not in ep.clients
        nursery.cancel_scope.cancel()


def _delta(rid: str, token: int) -> cm.Delta:
    return cm.Delta(request_id=rid, text=f"t{token}", token_ids=[token])


async def test_a_steps_messages_reach_a_client_that_asked_as_one_batch(autojump_clock):
    ep, wire, _, _ = endpoint()
    wire.decoder = Decoder(cm.ClientInbound)
    ep.open(b"A", "1", batch=True)
    ep.open(b"A", "2")  # one request asking is enough: the whole connection takes batches
    ep.open(b"B", "1")  # B never asked
    final = cm.Final(
        request_id="2", finish_reason="length", usage=cm.Usage(3, 1), timings=cm.Timings()
    )
    with ep.batching():
        ep.send(b"A", _delta("1", 5))
        ep.send(b"B", _delta("1", 6))
        ep.send(b"A", _delta("2", 7))
        ep.send(b"A", final)
        assert wire.sent[b"B"] == [_delta("1", 6)]  # sent at once, as before
        assert b"A" not in wire.sent  # held until the step's end
    assert wire.sent[b"A"] == [cm.Batch(items=[_delta("1", 5), _delta("2", 7), final])]
    pong = Pong(actor="tokenizer", nonce=1)
    with ep.batching():
        ep.send(b"A", _delta("1", 8))
        ep.send(b"A", pong)  # anything but a delta or final: what waits goes out first
        ep.send(b"A", _delta("1", 9))
    assert wire.sent[b"A"][1:] == [_delta("1", 8), pong, _delta("1", 9)]  # lone ones unwrapped
    ep.send(b"A", _delta("1", 10))  # outside a batching step: at once
    assert wire.sent[b"A"][-1] == _delta("1", 10)


async def test_a_client_found_gone_in_a_step_is_sent_nothing_more(autojump_clock):
    woken = []
    ep, wire, gone, _ = endpoint(lambda: woken.append(True))
    wire.decoder = Decoder(cm.ClientInbound)
    ids = [ep.open(b"A", "1", batch=True), ep.open(b"A", "2")]
    wire.gone.add(b"A")
    with ep.batching():
        ep.send(b"A", _delta("1", 5))
        ep.send(b"A", _delta("2", 6))
    assert woken == [True] and b"A" not in wire.sent  # the batch's send found it gone
    with ep.batching():
        ep.send(b"A", _delta("1", 7))  # leaving: dropped, not held
    assert woken == [True]
    ep.settle()
    assert gone == [ids]
