"""A multi-node engine, as vLLM's multiprocessing launch runs one (`--nnodes N --node-rank R
--master-addr A --master-port P`, `--headless` on every node but the first).

The leader (node rank 0) runs the API server; it listens on the master address for the other
nodes and serves only once all of them have joined (vLLM's engine starts after the
torch.distributed rendezvous of every rank). A worker (`--headless`) serves no HTTP: it dials the
leader until it is there, holds its connection, and exits with an error when the leader goes
(its ranks lost their group). A worker lost after the group formed takes the engine down: the
leader exits with an error, as vLLM's engine does when a rank dies. The wire is one line per
worker, `<node rank>\\n`; nothing else is exchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from xpyd.common.netguard import require_loopback

log = logging.getLogger(__name__)

#: How long a worker keeps dialling a leader that is not there yet.
JOIN_TIMEOUT_S = 600.0
RETRY_S = 0.5


class GroupFailed(Exception):
    """The group lost a node: the engine cannot go on."""


@dataclass(frozen=True)
class GroupSpec:
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    headless: bool

    def check(self) -> None:
        """vLLM's own launch rules (arg_utils.py, entrypoints/cli/serve.py)."""
        if self.nnodes < 1:
            raise ValueError("--nnodes must be at least 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be between 0 and {self.nnodes - 1}; got {self.node_rank}")
        if self.node_rank > 0 and not self.headless:
            raise ValueError("a node with --node-rank above 0 runs no API server: it needs --headless")
        if self.headless and self.node_rank == 0:
            raise ValueError("--headless on node rank 0: the first node runs the API server")
        require_loopback(self.master_addr, "--master-addr")


class GroupLeader:
    """The leader's side: accepts the workers, knows whether all are there, fails when one goes."""

    def __init__(self, spec: GroupSpec) -> None:
        self.spec = spec
        self.joined: dict[int, asyncio.StreamWriter] = {}
        self.failed = asyncio.Event()
        self.failure = ""
        self._server: asyncio.Server | None = None

    @property
    def waiting_for(self) -> str | None:
        """Why the engine cannot serve yet (None once every worker joined)."""
        missing = self.spec.nnodes - 1 - len(self.joined)
        if self.failure:
            return self.failure
        return f"waiting for {missing} of {self.spec.nnodes - 1} worker node(s) to join" if missing else None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.spec.master_addr, self.spec.master_port)
        log.info("group leader listening on %s:%d for %d worker node(s)", self.spec.master_addr,
                 self.spec.master_port, self.spec.nnodes - 1)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), timeout=10)
            rank = int(line.decode().strip())
        except (TimeoutError, ValueError, UnicodeDecodeError, ConnectionError):
            writer.close()
            return
        if not 0 < rank < self.spec.nnodes or rank in self.joined:
            log.warning("refused a worker claiming node rank %r", rank)
            writer.close()
            return
        self.joined[rank] = writer
        log.info("worker node %d joined (%d of %d)", rank, len(self.joined), self.spec.nnodes - 1)
        with contextlib.suppress(ConnectionError):
            await reader.read()  # until the worker's connection closes
        self.joined.pop(rank, None)
        if not self.failed.is_set():
            self.failure = f"worker node {rank} left the group"
            log.error("%s: the engine cannot go on", self.failure)
            self.failed.set()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self.joined.values()):
            writer.close()
        self.joined.clear()


async def run_worker(spec: GroupSpec, stop: asyncio.Event) -> None:
    """A headless node: join the leader and hold on until `stop` (return) or until the leader goes
    (GroupFailed)."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while True:
        try:
            reader, writer = await asyncio.open_connection(spec.master_addr, spec.master_port)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise GroupFailed(f"no leader at {spec.master_addr}:{spec.master_port} after "
                                  f"{JOIN_TIMEOUT_S:.0f} s") from None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), RETRY_S)
            if stop.is_set():
                return
    writer.write(f"{spec.node_rank}\n".encode())
    await writer.drain()
    log.info("node %d joined the leader at %s:%d", spec.node_rank, spec.master_addr, spec.master_port)
    gone = asyncio.ensure_future(reader.read())
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({gone, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        writer.close()
        for task in (gone, stopping):
            task.cancel()
    if not stop.is_set():
        raise GroupFailed(f"the leader at {spec.master_addr}:{spec.master_port} left the group")
