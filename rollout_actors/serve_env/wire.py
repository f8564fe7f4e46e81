"""The client-facing socket of verifiers 0.4's serve protocol (`verifiers/v1/serve/server.py`): a ZMQ
ROUTER. A client's DEALER sends `[request_id, method, msgpack(payload)]`; the ROUTER adds the client's
identity frame in front, and strips it from what is sent back: `[request_id, b"delta" | b"reply", data]`.
Options as verifiers sets them: unbounded queues both ways (a run's deltas never block the episode),
no linger, and `ROUTER_MANDATORY` so a reply to a client that left fails here instead of vanishing.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import zmq
import zmq.asyncio

logger = logging.getLogger(__name__)

SEND_TIMEOUT_S = 10.0
"""A send never waits on a slow reader (unbounded queue); this only bounds a socket in trouble."""
RECEIVE_POLL_MS = 100  # how often the receive loop looks up to notice it was closed


@dataclass(frozen=True, slots=True)
class Inbound:
    """One request as it arrived: the client's identity, its request id, the method and the payload."""

    client: bytes
    request_id: bytes
    method: bytes
    payload: bytes


class RouterWire:
    """wire = RouterWire("tcp://127.0.0.1:5555")     # bound at once; `wire.address` is the real endpoint
    request = await wire.receive()                     # an `Inbound`, or None for a malformed message
    await wire.send(request, b"reply", data)
    wire.close()
    """

    def __init__(self, address: str) -> None:
        self._ctx = zmq.asyncio.Context()
        self._socket = self._ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(address)
        except zmq.ZMQError:
            self._socket.close()
            self._ctx.term()
            raise
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        """The bound endpoint (a `:0` port resolved)."""
        self._poller = zmq.asyncio.Poller()
        self._poller.register(self._socket, zmq.POLLIN)

    async def receive(self) -> Inbound | None:
        """The next request; waits until one comes (cancel to stop). None for a malformed message."""
        while True:
            events = dict(await self._poller.poll(timeout=RECEIVE_POLL_MS))
            if self._socket in events:
                break
        frames = await self._socket.recv_multipart()
        if len(frames) != 4:
            logger.warning("serve-env: dropped a message of %d frames (want 4)", len(frames))
            return None
        return Inbound(*frames)

    async def send(self, to: Inbound, kind: bytes, data: bytes) -> bool:
        """Send one frame of `to`'s answer; False when the client is gone (nothing is then waiting)."""
        try:
            await asyncio.wait_for(
                self._socket.send_multipart([to.client, to.request_id, kind, data], copy=False),
                SEND_TIMEOUT_S,
            )
            return True
        except (zmq.ZMQError, TimeoutError) as exc:
            logger.warning("serve-env: could not send %s for %s: %s", kind.decode(), to.request_id, exc)
            return False

    def close(self) -> None:
        self._socket.close()
        self._ctx.term()
