"""PeerSockets: the small all-reduces of tensor parallelism on CPU, over direct TCP between the
ranks instead of gloo (parallel.py uses it; BENCHMARKS.md, "Tensor parallelism on CPU")."""
from __future__ import annotations

import socket

import torch


class PeerSockets:
    """All-reduce of small CPU tensors over one TCP connection per pair of ranks: each rank
    sends its tensor to every other and sums all of them in rank order (the same sum, bit for
    bit, on every rank). Why: a gloo all-reduce of one decode row costs ~1-2 ms on the 2-core
    dev VM (thread hand-offs inside ProcessGroupGloo and gloo's device loop), where a socket
    round trip costs ~35 us (BENCHMARKS.md). Tensors above `limit` (what the socket buffers
    hold, so that every rank can send before any receives) go to gloo. A peer that dies
    closes its socket: the next receive raises. Opt-in (KVFLOW_TP_SOCKETS=1): torch.distributed
    (gloo) carries every collective by default; this is a measured alternative for the
    latency-bound decode all-reduces on small, oversubscribed CPU hosts."""

    def __init__(self, rank: int, world_size: int, all_gather, host: str, wait: float) -> None:
        """all_gather(obj) -> every rank's obj, by rank (the control group's)."""
        self.rank, self.world_size = rank, world_size
        server = socket.create_server((host, 0))
        server.settimeout(wait)     # a rank that died before connecting: an error, no hang
        addrs = all_gather((host, server.getsockname()[1]))
        self.socks: dict[int, socket.socket] = {}
        for r in range(rank):       # connect to the lower ranks, accept the higher ones
            s = socket.create_connection(addrs[r], timeout=wait)
            s.sendall(rank.to_bytes(4, "little"))
            self.socks[r] = s
        for _ in range(rank + 1, world_size):
            s, _ = server.accept()
            s.settimeout(wait)
            self.socks[int.from_bytes(_recv_exact(s, 4, -1), "little")] = s
        server.close()
        sizes = []
        for s in self.socks.values():
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                s.setsockopt(socket.SOL_SOCKET, opt, 1 << 20)
                sizes.append(s.getsockopt(socket.SOL_SOCKET, opt))
        # Linux reports twice the size it grants (the bookkeeping half): a quarter of what it
        # reports is half the data the two buffers hold. Every rank must pick the same path
        # for a tensor: the smallest limit of all.
        self.limit = min(all_gather(min(sizes) // 4))
        self._bufs = {r: bytearray(self.limit) for r in self.socks}

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        data = memoryview(t.view(torch.uint8).numpy()).cast("B")
        for s in self.socks.values():
            s.sendall(data)
        parts = [t] * self.world_size
        for r, s in self.socks.items():
            buf = _recv_exact(s, len(data), r, self._bufs[r])
            parts[r] = torch.frombuffer(buf, dtype=t.dtype, count=t.numel()).view(t.shape)
        total = parts[0] + parts[1]
        for p in parts[2:]:
            total += p
        return t.copy_(total)

    def close(self) -> None:
        for s in self.socks.values():
            s.close()


def _recv_exact(s: socket.socket, n: int, peer: int, buf: bytearray | None = None):
    buf = buf if buf is not None else bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = s.recv_into(view[got:n])
        if k == 0:
            raise ConnectionError(f"tensor-parallel rank {peer} closed its connection")
        got += k
    return buf
