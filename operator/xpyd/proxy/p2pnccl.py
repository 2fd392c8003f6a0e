"""P2pNcclConnector (vLLM <= 0.23) instance registration over ZMQ.

Each engine's P2pNcclEngine sends, every 3 seconds from a DEALER socket to the proxy's
`proxy_ip:proxy_port`, a msgpack map `{"type": "P" | "D", "http_address": "ip:port",
"zmq_address": "ip:port"}` (vLLM's `disagg_proxy_p2p_nccl_xpyd.py` is the reference proxy). An
instance not heard from for 5 seconds is dropped. The registered ZMQ address is what the request
id tells each side about its peer (`protocol.p2p_nccl_request_id`); for an instance discovery
knows but that has not registered, the proxy assumes `host:kv_port`.

`RegistrationTable` is the pure bookkeeping; `Registrations` runs the ROUTER socket in a thread.
pyzmq and msgpack are optional: without them `start()` raises a clear error and the proxy uses
discovery-based addresses only.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from xpyd.api.naming import Role
from xpyd.proxy.pool import Endpoint

log = logging.getLogger(__name__)

#: An instance is forgotten this long after its last heartbeat (the engines ping every 3 s).
EXPIRY_SECONDS: Final = 5.0
_ROLES: Final[dict[str, Role]] = {"P": "prefill", "D": "decode"}


@dataclass
class RegistrationTable:
    """Registered instances per role: http address -> (zmq address, expiry time)."""

    entries: dict[Role, dict[str, tuple[str, float]]] = field(
        default_factory=lambda: {"prefill": {}, "decode": {}})

    def register(self, message: Any, now: float) -> Role | None:
        """Record a heartbeat; returns the role whose set of addresses changed, else None."""
        if not isinstance(message, dict):
            return None
        decoded = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                   for k, v in message.items()}
        role = _ROLES.get(str(decoded.get("type")))
        http, zmq = decoded.get("http_address"), decoded.get("zmq_address")
        if role is None or not isinstance(http, str) or not isinstance(zmq, str) or not http or not zmq:
            return None
        previous = self.entries[role].get(http)
        self.entries[role][http] = (zmq, now + EXPIRY_SECONDS)
        return role if previous is None or previous[0] != zmq else None

    def expire(self, now: float) -> list[Role]:
        """Forget instances whose heartbeat is overdue; the roles that changed."""
        changed: list[Role] = []
        for role, entries in self.entries.items():
            stale = [http for http, (_, expiry) in entries.items() if expiry < now]
            for http in stale:
                del entries[http]
            if stale:
                changed.append(role)
        return changed

    def endpoints(self, role: Role) -> list[Endpoint]:
        """The registered instances of a role."""
        return [Endpoint(url=f"http://{http}", zmq_address=zmq) for http, (zmq, _) in self.entries[role].items()]


class Registrations:
    """The ZMQ ROUTER socket engines register with; publishes each role's registered endpoints
    through `publish(role, endpoints)` (called from this object's thread)."""

    def __init__(self, host: str, port: int, publish: Callable[[Role, list[Endpoint]], None]) -> None:
        self.address = f"tcp://{host}:{port}"
        self.publish = publish
        self.table = RegistrationTable()
        self.stopping = threading.Event()

    def start(self) -> threading.Thread:
        """Bind and serve in a daemon thread; RuntimeError when pyzmq or msgpack is missing."""
        try:
            zmq = importlib.import_module("zmq")
            msgpack = importlib.import_module("msgpack")
        except ImportError as error:
            raise RuntimeError(f"P2pNccl registration needs pyzmq and msgpack ({error})") from None
        context = zmq.Context.instance()
        socket = context.socket(zmq.ROUTER)
        socket.bind(self.address)
        thread = threading.Thread(target=self._serve, args=(zmq, msgpack, socket), name="p2p-nccl-registration",
                                  daemon=True)
        thread.start()
        log.info("P2pNccl registration on %s", self.address)
        return thread

    def stop(self) -> None:
        """Ask the thread to end (it notices within a second)."""
        self.stopping.set()

    def _serve(self, zmq: Any, msgpack: Any, socket: Any) -> None:
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        try:
            while not self.stopping.is_set():
                now = time.monotonic()
                changed = set(self.table.expire(now))
                if dict(poller.poll(1000)).get(socket):
                    frames = socket.recv_multipart()
                    try:
                        message = msgpack.loads(frames[-1])
                    except Exception:  # a malformed heartbeat must not stop registration
                        log.warning("P2pNccl registration: undecodable message ignored")
                        continue
                    role = self.table.register(message, now)
                    if role is not None:
                        changed.add(role)
                for role in changed:
                    self.publish(role, self.table.endpoints(role))
        finally:
            socket.close(linger=0)
