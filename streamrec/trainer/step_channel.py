"""The ranks' per-step agreement: a few integers from every rank to every rank, and an array
of int64 from every rank to each other rank (the exchange's keys for their owner), over one
TCP connection per pair of ranks.

Why not a gloo ``all_gather``: the agreement runs once a step on the training thread, and
gloo's costs several hundred microseconds even when no rank waits for another (its work
goes through a worker thread and several messages), a step's largest fixed cost on two
ranks after the exchange itself (bench/RESULTS.md, "Trainer scaling"). Here a rank writes
its row to every other rank and reads theirs: two system calls a peer, no thread between.

The connections are made once, when the ranks join: each rank listens on the address that
routes to the rendezvous host (``MASTER_ADDR``; loopback without one), the ranks learn each
other's addresses through a gloo ``all_gather_object``, and each connects to the ranks below
it. A rank that dies closes its connections, so the others fail at their next agreement
instead of waiting; one that hangs makes them fail after ``timeout_s``. A rank writes to
and reads from all its peers at once (``poll``), so rows and arrays of any size go
through without two ranks each waiting for the other to read first.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import time
from typing import Any, Sequence

import numpy as np
import torch.distributed as dist

_HEADER = struct.Struct("<II")  # bytes of the row that follows (a check: every rank's row has the same length); of the array after it
_RANK = struct.Struct("<q")  # a connecting rank says who it is


class PeerLost(ConnectionError):
    """A rank closed its connection (it stopped or died) or did not answer in time."""


class StepChannel:
    """Every rank's row of int64, on every rank (``all_gather``), with an int64 array of any
    length from every rank to each other one (``exchange``). Every rank must call it the
    same number of times with rows of the same length, as with any collective."""

    def __init__(self, rank: int, world: int, peers: dict[int, socket.socket], timeout_s: float = 600.0) -> None:
        """``peers``: a connected socket to every other rank (made non-blocking here: the
        channel waits in ``poll``, for at most ``timeout_s`` a round)."""
        self.rank, self.world, self.peers, self.timeout_s = rank, world, peers, timeout_s
        for conn in peers.values():
            conn.setblocking(False)

    @classmethod
    def open(cls, rank: int, world: int, group: Any, timeout_s: float) -> "StepChannel":
        """Connect every pair of ranks (collective over the gloo ``group``, once)."""
        host = _reachable_address()
        listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                        backlog=max(1, world))
        listener.settimeout(timeout_s)
        addresses: list[Any] = [None] * world
        dist.all_gather_object(addresses, listener.getsockname()[:2], group=group)
        peers: dict[int, socket.socket] = {}
        try:
            for lower in range(rank):
                conn = socket.create_connection(tuple(addresses[lower]), timeout=timeout_s)
                conn.sendall(_RANK.pack(rank))
                peers[lower] = conn
            for _ in range(rank + 1, world):
                conn, _ = listener.accept()
                conn.settimeout(timeout_s)
                peers[_RANK.unpack(_read(conn, _RANK.size, "a joining rank"))[0]] = conn
        except BaseException:
            for conn in peers.values():
                conn.close()
            raise
        finally:
            listener.close()
        for conn in peers.values():
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(rank, world, peers, timeout_s)

    def all_gather(self, row: Sequence[int]) -> list[list[int]]:
        """``row`` from every rank, in rank order (raises PeerLost)."""
        return self.exchange(row)[0]

    def exchange(self, row: Sequence[int], to_each: Sequence[np.ndarray] | None = None
                 ) -> tuple[list[list[int]], list[np.ndarray]]:
        """``row`` from every rank, in rank order; and ``to_each[r]`` (int64 [any], host) to
        rank ``r``: returns (every rank's row, what each rank sent this one: int64 arrays in
        rank order, this rank's own ``to_each[rank]`` at its place; empty without ``to_each``).
        Raises PeerLost."""
        payload = np.asarray(row, dtype="<i8").tobytes()
        arrays = [np.ascontiguousarray(a, dtype="<i8") for a in to_each] if to_each is not None else None
        if arrays is not None and len(arrays) != self.world:
            raise ValueError(f"exchange needs an array for each of the {self.world} ranks, got {len(arrays)}")
        outgoing = {}
        for peer in self.peers:
            extra = arrays[peer].tobytes() if arrays is not None else b""
            outgoing[peer] = memoryview(_HEADER.pack(len(payload), len(extra)) + payload + extra)
        received = self._send_and_receive(outgoing, len(payload))
        rows: list[list[int]] = []
        extras: list[np.ndarray] = []
        fixed = _HEADER.size + len(payload)  # every rank's header and row: as long as ours (checked on arrival)
        for r in range(self.world):
            if r == self.rank:
                rows.append(list(row))
                extras.append(arrays[r] if arrays is not None else np.empty(0, np.int64))
                continue
            message = received[r]
            rows.append(np.frombuffer(message, dtype="<i8", count=len(payload) // 8, offset=_HEADER.size).tolist())
            extras.append(np.frombuffer(message, dtype="<i8", offset=fixed).astype(np.int64, copy=False))
        return rows, extras

    def _send_and_receive(self, outgoing: dict[int, memoryview], row_bytes: int) -> dict[int, bytearray]:
        """Write each peer's message and read each peer's (its header and a row of
        ``row_bytes``, then the array the header announces), all at once: no peer waits for
        another to read first. Each pass tries every pending write and read, then waits
        (``poll``: no limit on descriptor numbers) only for what is left."""
        fixed = _HEADER.size + row_bytes
        sent = dict.fromkeys(outgoing, 0)
        inbox = {peer: bytearray() for peer in self.peers}
        wanted = dict.fromkeys(self.peers, fixed)  # until the header says how long the array is
        deadline = None
        while True:
            for peer, message in outgoing.items():
                if sent[peer] < len(message):
                    try:
                        sent[peer] += self.peers[peer].send(message[sent[peer]:])
                    except (BlockingIOError, InterruptedError):
                        pass
                    except OSError as exc:
                        raise PeerLost(f"rank {peer} is gone ({exc})") from None
            for peer, conn in self.peers.items():
                while len(inbox[peer]) < wanted[peer]:
                    try:
                        chunk = conn.recv(wanted[peer] - len(inbox[peer]))
                    except (BlockingIOError, InterruptedError):
                        break
                    except OSError as exc:
                        raise PeerLost(f"rank {peer} is gone ({exc})") from None
                    if not chunk:
                        raise PeerLost(f"rank {peer} closed its connection (it stopped or died)")
                    before = len(inbox[peer])
                    inbox[peer] += chunk
                    if before < _HEADER.size <= len(inbox[peer]):  # the header is in: check the row, learn the array's length
                        theirs, extra = _HEADER.unpack_from(inbox[peer])
                        if theirs != row_bytes:
                            raise ValueError(f"rank {peer} sent a row of {theirs // 8} integers, this rank "
                                             f"{row_bytes // 8}: the ranks do not run the same step")
                        wanted[peer] = fixed + extra
            pending = {conn.fileno(): (select.POLLOUT if peer in outgoing and sent[peer] < len(outgoing[peer]) else 0)
                       | (select.POLLIN if len(inbox[peer]) < wanted[peer] else 0) for peer, conn in self.peers.items()}
            pending = {fd: events for fd, events in pending.items() if events}
            if not pending:
                return inbox
            now = time.monotonic()
            deadline = deadline or now + self.timeout_s
            if now >= deadline:
                late = next(p for p, c in self.peers.items() if c.fileno() in pending)
                raise PeerLost(f"rank {late} did not answer within {self.timeout_s:.0f} s")
            poller = select.poll()
            for fd, events in pending.items():
                poller.register(fd, events)
            poller.poll((deadline - now) * 1000)

    def close(self) -> None:
        for conn in self.peers.values():
            conn.close()
        self.peers = {}


def _read(conn: socket.socket, size: int, who: str) -> bytes:
    """Exactly ``size`` bytes from ``conn``."""
    data = bytearray()
    while len(data) < size:
        try:
            chunk = conn.recv(size - len(data))
        except socket.timeout:
            raise PeerLost(f"{who} did not answer within {conn.gettimeout():.0f} s") from None
        except OSError as exc:
            raise PeerLost(f"{who} is gone ({exc})") from None
        if not chunk:
            raise PeerLost(f"{who} closed its connection (it stopped or died)")
        data += chunk
    return bytes(data)


def _reachable_address() -> str:
    """This host's address on the route to the rendezvous host (``MASTER_ADDR``), which the
    other hosts reach it by too; loopback when the ranks joined without one (a file rendezvous)."""
    master = os.environ.get("MASTER_ADDR")
    if not master:
        return "127.0.0.1"
    family, _, _, _, address = socket.getaddrinfo(master, int(os.environ.get("MASTER_PORT", "29500")), type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)  # no packet is sent: this only picks the route
        return probe.getsockname()[0]
