"""Tensor parallelism (Megatron-style) over torch.distributed: the process group, the shard
sizes of a model, the slices of its checkpoint weights, and the collectives of a forward pass.

With tensor_parallel_size 1 none of this runs: a model built without a TPGroup (tp=None) takes
its single-process path, with no collective and no extra op.

Each of N ranks holds
- a contiguous run of KV heads and the q heads that read them (KV/N each when N divides KV;
  else, with KV > N, KV // N or KV // N + 1: the default SmolLM2-135M's 3 KV heads split 1 + 2
  on 2 ranks; with KV < N, H/N q heads and the one KV head they read, replicated), and the rows
  of q/k/v and gate/up for them (column-parallel: no communication);
- the matching columns of o_proj and down_proj (row-parallel: each rank's product is a partial
  sum, all-reduced; the residual is added on rank 0 only, so that it counts once);
- V/N rows of the embedding and the LM head (vocab-parallel; padded with zero rows when
  N does not divide V): an id outside a rank's rows embeds to zeros there, and the all-reduce
  sums the one rank's row; the logits' shards are gathered on rank 0, which alone samples.

Two process groups (as vLLM's): the compute group (gloo on CPU, NCCL on CUDA) for the
forward's all-reduces and gathers, with a timeout that bounds the wait on a hung rank (on CPU,
with KVFLOW_TP_SOCKETS=1, the small all-reduces go over direct sockets instead: PeerSockets,
an opt-in measured on the dev VM); and a
gloo control group for the step messages (control.py), whose timeout is long because a worker
waits there as long as the engine is idle. A rank that dies closes its sockets, so the others'
next collective raises at once (gloo: "Connection closed by peer") instead of hanging.
"""
from __future__ import annotations

import dataclasses
import datetime
import pickle
import socket

import torch
import torch.distributed as dist

from kvflow import envs
from kvflow.model.config import ModelConfig
from kvflow.model.distributed.peer_sockets import PeerSockets

# A worker waits on the control group for the next step while the engine is idle.
_CONTROL_TIMEOUT = datetime.timedelta(days=30)
# Step messages up to this size (a decode step of ~100 requests) take one broadcast.
_MESSAGE_BUFFER = 16384


def check_tp_size(cfg: ModelConfig, n: int) -> None:
    """ValueError (naming tensor_parallel_size) unless this model splits into n ranks."""
    if n == 1:
        return
    if cfg.intermediate_size % n:
        raise ValueError(f"tensor_parallel_size={n} must divide the model's "
                         f"intermediate_size={cfg.intermediate_size}")
    kv = cfg.num_kv_heads
    if kv < n and (n % kv or cfg.num_heads % n):
        raise ValueError(f"tensor_parallel_size={n} exceeds the model's num_kv_heads={kv}: it "
                         f"must then be a multiple of it and divide num_heads={cfg.num_heads}")


def head_range(cfg: ModelConfig, n: int, rank: int) -> tuple[int, int, int, int]:
    """(first q head, q heads, first KV head, KV heads) of this rank."""
    kv, group = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    if kv >= n:
        lo, hi = rank * kv // n, (rank + 1) * kv // n
        return lo * group, (hi - lo) * group, lo, hi - lo
    h = cfg.num_heads // n
    return rank * h, h, rank * h // group, 1


def max_kv_heads(cfg: ModelConfig, n: int) -> int:
    """The most KV heads any rank holds (what sizes the KV cache's memory per block)."""
    return max(head_range(cfg, n, r)[3] for r in range(n))


def local_config(cfg: ModelConfig, n: int, rank: int) -> ModelConfig:
    """The shape of one rank's shard (vocab_size: its rows of the padded vocabulary)."""
    _, h, _, kv = head_range(cfg, n, rank)
    return dataclasses.replace(
        cfg, num_heads=h, num_kv_heads=kv, intermediate_size=cfg.intermediate_size // n,
        vocab_size=-(-cfg.vocab_size // n))


@dataclasses.dataclass(eq=False)
class TPGroup:
    rank: int
    world_size: int
    control: object         # the gloo group of the step messages
    device: str = "cpu"
    peers: PeerSockets | None = None    # CPU, opt-in: small all-reduces over direct sockets
    world: object = None    # the default group made for this TPGroup (destroy())
    _buf: torch.Tensor = dataclasses.field(
        default_factory=lambda: torch.empty(_MESSAGE_BUFFER, dtype=torch.uint8))

    # ---- step messages (rank 0 -> every rank) --------------------------------------------
    def send(self, obj) -> None:
        """Broadcast a picklable object from rank 0: its length and first bytes in one fixed
        buffer (one collective for a usual step), the rest, if any, in a second. Pickle, as
        broadcast_object_list: the ranks trust each other."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        n = len(data)
        head = min(n, _MESSAGE_BUFFER - 8)
        a = self._buf.numpy()
        a[:8] = memoryview(n.to_bytes(8, "little"))
        a[8:8 + head] = memoryview(data)[:head]
        dist.broadcast(self._buf, 0, group=self.control)
        if n > head:
            rest = torch.frombuffer(bytearray(data[head:]), dtype=torch.uint8)
            dist.broadcast(rest, 0, group=self.control)

    def recv(self):
        """The object rank 0 sent (blocks until it does, or raises when rank 0 is gone)."""
        dist.broadcast(self._buf, 0, group=self.control)
        a = self._buf.numpy()
        n = int.from_bytes(a[:8].tobytes(), "little")
        head = min(n, _MESSAGE_BUFFER - 8)
        data = a[8:8 + head].tobytes()
        if n > head:
            rest = torch.empty(n - head, dtype=torch.uint8)
            dist.broadcast(rest, 0, group=self.control)
            data += rest.numpy().tobytes()
        return pickle.loads(data)

    def barrier(self) -> None:
        """A collective on the compute group: every rank got here (or this raises)."""
        dist.all_reduce(torch.zeros(1, device=self.device))

    # ---- the forward's collectives ---------------------------------------------------------
    def reduce_linear(self, x: torch.Tensor, m, residual: torch.Tensor | None) -> torch.Tensor:
        """residual + x @ W.T summed over the ranks (row-parallel W, no bias: o_proj and
        down_proj have none): the residual joins rank 0's partial sum only."""
        from kvflow.model.models.layers import linear
        y = linear(x, m, residual if self.rank == 0 else None)
        return self.all_reduce(y)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum t over the ranks, in place (t contiguous)."""
        if self.peers is not None and t.nbytes <= self.peers.limit:
            return self.peers.all_reduce(t)
        dist.all_reduce(t)
        return t

    def embed(self, m, ids: torch.Tensor, rows: int) -> torch.Tensor:
        """Vocab-parallel lookup: this rank's rows [rank * rows, (rank + 1) * rows), zeros for
        the other ids, summed over the ranks."""
        from kvflow.model.quantization.quant_weights import embed
        local = ids - self.rank * rows
        outside = (local < 0) | (local >= rows)
        h = embed(m, local.masked_fill(outside, 0))
        h.masked_fill_(outside.unsqueeze(1), 0)
        return self.all_reduce(h)

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Rank 0: the full [T, vocab_size] logits; other ranks: their own shard (unused)."""
        local = local.contiguous()
        if self.rank != 0:
            dist.gather(local, None, dst=0)
            return local
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.gather(local, parts, dst=0)
        logits = torch.cat(parts, dim=1)
        return logits if logits.shape[1] == vocab_size else logits[:, :vocab_size].contiguous()

    # ---- the checkpoint's slices -----------------------------------------------------------
    def shard_weight(self, name: str, w: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
        """This rank's slice of checkpoint weight `name` (HF name without "model."); cfg is the
        whole model's shape. Weights not split (norms) come back as they are."""
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"{name}: quantized weights are dequantized before sharding")
        parts = name.split(".")
        module = parts[-2] if len(parts) > 1 else ""
        n, r, d = self.world_size, self.rank, cfg.head_dim
        q0, h, kv0, kv = head_range(cfg, n, r)
        if module == "q_proj":
            return w.narrow(0, q0 * d, h * d)
        if module in ("k_proj", "v_proj"):
            return w.narrow(0, kv0 * d, kv * d)
        if module in ("gate_proj", "up_proj"):
            i = cfg.intermediate_size // n
            return w.narrow(0, r * i, i)
        if module == "o_proj":
            return w.narrow(1, q0 * d, h * d)
        if module == "down_proj":
            i = cfg.intermediate_size // n
            return w.narrow(1, r * i, i)
        if module in ("embed_tokens", "lm_head"):
            return _vocab_rows(w, r, -(-cfg.vocab_size // n))
        return w


def _vocab_rows(w: torch.Tensor, rank: int, rows: int) -> torch.Tensor:
    part = w[rank * rows:(rank + 1) * rows]
    if part.shape[0] == rows:
        return part
    pad = w.new_zeros((rows - part.shape[0],) + tuple(w.shape[1:]))
    return torch.cat([part, pad])


def _host_toward(addr: str) -> str:
    """This machine's address on the route to addr (the master): the one the others reach."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((addr, 1))
        return s.getsockname()[0]


def timeout() -> datetime.timedelta:
    """How long a compute collective waits for a slow or hung rank (KVFLOW_TP_TIMEOUT)."""
    return datetime.timedelta(seconds=envs.KVFLOW_TP_TIMEOUT)


def init_distributed(rank: int, world_size: int, device: str, master_addr: str,
                     master_port: int, local_rank: int = 0) -> TPGroup:
    """Join the process group (all ranks call this; rank 0 hosts the rendezvous store at
    master_addr:master_port). gloo on CPU, NCCL on CUDA (device cuda:local_rank)."""
    backend = "gloo"
    if device == "cuda":
        backend = "nccl"
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}",
                            rank=rank, world_size=world_size, timeout=timeout())
    control = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
    peers = None
    if device == "cpu" and envs.KVFLOW_TP_SOCKETS:
        def all_gather(obj) -> list:
            out: list = [None] * world_size
            dist.all_gather_object(out, obj, group=control)
            return out
        peers = PeerSockets(rank, world_size, all_gather, _host_toward(master_addr),
                            timeout().total_seconds())
    return TPGroup(rank, world_size, control, device, peers, dist.group.WORLD)


def destroy(tp: TPGroup) -> None:
    """Leave tp's process group, if it is still this process's (not a later engine's)."""
    if tp.peers is not None:
        tp.peers.close()
    if dist.is_initialized() and dist.group.WORLD is tp.world:
        dist.destroy_process_group()
