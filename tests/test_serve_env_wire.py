"""The serve-env ROUTER speaks verifiers' framing: a DEALER's `[request_id, method, payload]` arrives with
the client's identity, and what is sent back reaches that client as `[request_id, kind, data]`. No Ray."""

from __future__ import annotations

import asyncio

import msgpack
import zmq
import zmq.asyncio

from rollout_actors.kernel import Failure
from rollout_actors.serve_env.runs import failure_reply
from rollout_actors.serve_env.wire import RouterWire


async def _round_trip() -> tuple[object, list[bytes], list[bytes], bool]:
    wire = RouterWire("tcp://127.0.0.1:0")
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(wire.address)
    try:
        await dealer.send_multipart([b"r1", b"run", msgpack.packb({"x": 1})])
        await dealer.send_multipart([b"only-two", b"frames"])  # malformed: dropped, the loop goes on
        request = await asyncio.wait_for(wire.receive(), 10)
        malformed = await asyncio.wait_for(wire.receive(), 10)
        assert request is not None
        await wire.send(request, b"delta", b"d")
        await wire.send(
            request, b"reply", failure_reply(Failure(type="PartLost", message="env server x died"))
        )
        delta = await asyncio.wait_for(dealer.recv_multipart(), 10)
        reply = await asyncio.wait_for(dealer.recv_multipart(), 10)
        return (request, malformed), delta, reply, wire.address.startswith("tcp://127.0.0.1:")
    finally:
        dealer.close()
        ctx.term()
        wire.close()


def test_router_frames_round_trip_as_verifiers_frames_them():
    (request, malformed), delta, reply, bound = asyncio.run(_round_trip())
    assert request.request_id == b"r1" and request.method == b"run"
    assert msgpack.unpackb(request.payload) == {"x": 1}
    assert malformed is None
    assert delta == [b"r1", b"delta", b"d"]
    assert reply[:2] == [b"r1", b"reply"]
    assert msgpack.unpackb(reply[2]) == {"success": False, "error": "PartLost: env server x died"}
    assert bound  # a :0 port resolved to the real endpoint
