"""The ranks' per-step agreement: a few integers from every rank to every rank, over one TCP
connection per pair of ranks.

Why not a gloo ``all_gather``: the agreement runs once a step on the training thread, and
gloo's costs several hundred microseconds even when no rank waits for another (its work
goes through a worker thread and several messages), a step's largest fixed cost on two
ranks after the exchange itself (bench/RESULTS.md, "Trainer scaling"). Here a rank writes
its row to every other rank and reads theirs: two system calls a peer, no thread between.

The connections are made once, when the ranks join: each rank listens on the address that
routes to the rendezvous host (``MASTER_ADDR``; loopback without one), the ranks learn each
other's addresses through a gloo ``all_gather_object``, and each connects to the ranks below
it. A rank that dies closes its connections, so the others fail at their next agreement
instead of waiting; one that hangs makes them fail after ``timeout_s``.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Any, Sequence

import numpy as np
import torch.distributed as dist

_HEADER = struct.Struct("<I")  # bytes of the row that follows (a check: every rank's row has the same length)
_RANK = struct.Struct("<q")  # a connecting rank says who it is


class PeerLost(ConnectionError):
    """A rank closed its connection (it stopped or died) or did not answer in time."""


class StepChannel:
    """Every rank's row of int64, on every rank (``all_gather``). Every rank must call it
    the same number of times with rows of the same length, as with any collective."""

    def __init__(self, rank: int, world: int, peers: dict[int, socket.socket]) -> None:
        self.rank, self.world, self.peers = rank, world, peers

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
            conn.settimeout(timeout_s)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(rank, world, peers)

    def all_gather(self, row: Sequence[int]) -> list[list[int]]:
        """``row`` from every rank, in rank order (raises PeerLost)."""
        payload = np.asarray(row, dtype="<i8").tobytes()
        message = _HEADER.pack(len(payload)) + payload
        for peer, conn in self.peers.items():
            try:
                conn.sendall(message)
            except OSError as exc:
                raise PeerLost(f"rank {peer} is gone ({exc})") from None
        rows: list[list[int]] = []
        for r in range(self.world):
            if r == self.rank:
                rows.append(list(row))
                continue
            received = _read(self.peers[r], len(message), f"rank {r}")  # one read: the rows are as long as ours
            if _HEADER.unpack_from(received)[0] != len(payload):
                raise ValueError(f"rank {r} sent a row of {_HEADER.unpack_from(received)[0] // 8} integers, this rank "
                                 f"{len(payload) // 8}: the ranks do not run the same step")
            rows.append(np.frombuffer(received, dtype="<i8", offset=_HEADER.size).tolist())
        return rows

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
