"""The one place that picks a tensor-parallel rank's device and communicator by the group's device.

CPU: the shared-memory one-shot all-reduce (shm_comm.py) with a gloo group for oversized
messages; rank 0 creates the segment before it starts the workers, who attach by name.
CUDA: rank r runs on the r-th GPU after the group's first one (device "cuda:N": N + r; "cuda":
r, i.e. of the visible devices) and talks through GpuCommunicator (NCCL + symmetric memory).
TPLLM_TP_TRANSPORT=gloo (CPU): every collective through gloo library calls, the transport
between hosts (gloo_comm.py); measurable on one host, e.g. `bench tp` with and without it.
Multi-host groups (spec.master_addr set) always use it, over rank 0's TCP store.
"""
from __future__ import annotations

import datetime
import os
import secrets
from collections.abc import Callable

import torch
import torch.distributed as dist

from backend.parallel.context import Communicator
from backend.parallel.shm_comm import ShmCommunicator
from backend.parallel.spec import WorkerSpec


def on_gpu(device: str) -> bool:
    return torch.device(device).type == "cuda"


def rank_device(device: str, rank: int) -> torch.device:
    """Where tensor-parallel rank `rank` of a group on `device` runs."""
    d = torch.device(device)
    if d.type != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", (d.index or 0) + rank)


TRANSPORT_ENV = "TPLLM_TP_TRANSPORT"


def cpu_transport(spec: WorkerSpec | None = None) -> str:
    if spec is not None and spec.master_addr:
        return "gloo"  # multi-host: shared memory does not reach the other hosts
    value = os.environ.get(TRANSPORT_ENV, "shm").strip().lower() or "shm"
    if value not in ("shm", "gloo"):
        raise ValueError(f"{TRANSPORT_ENV}={value!r}: must be shm or gloo")
    return value


def local_segment(spec: WorkerSpec, dtype: torch.dtype,
                  peers_alive: Callable[[], bool]) -> ShmCommunicator | None:
    """Rank 0, before the workers start: the CPU path's shared-memory segment; None on GPU or
    with the gloo transport."""
    if on_gpu(spec.device) or cpu_transport(spec) == "gloo":
        return None
    return ShmCommunicator(f"tpllm_{os.getpid()}_{secrets.token_hex(4)}", 0, spec.world,
                           spec.slot_bytes, dtype, create=True, peers_alive=peers_alive)


def rendezvous_store(spec: WorkerSpec, timeout: datetime.timedelta) -> dist.Store:
    """The group's store: a file in rank 0's private temp directory (no port is opened); every
    rank opens the same path. Multi-host: a TCP store rank 0 hosts on master_addr:master_port."""
    if spec.master_addr:
        try:  # the server listens on every interface; clients retry until `timeout`
            return dist.TCPStore(spec.master_addr, spec.master_port, spec.world, spec.rank == 0,
                                 timeout, wait_for_workers=False)
        except RuntimeError as e:
            raise RuntimeError(f"tp_master_port: rank {spec.rank} cannot "
                               f"{'host' if spec.rank == 0 else 'reach'} the rendezvous store "
                               f"at {spec.master_addr}:{spec.master_port} ({e})") from None
    store = dist.FileStore(spec.store_path, spec.world)
    store.set_timeout(timeout)
    return store


def gloo_group(spec: WorkerSpec, store: dist.Store,
               timeout: datetime.timedelta) -> dist.ProcessGroupGloo:
    """A gloo group over `store`. Multi-host, its sockets bind to spec.gloo_host (an address the
    other hosts reach: torch's default, the hostname's address, may be loopback-only) unless
    GLOO_SOCKET_IFNAME names the interface, and its collectives fail after
    spec.collective_timeout_s instead of the start-up timeout (a silent peer host)."""
    if not spec.gloo_host or os.environ.get("GLOO_SOCKET_IFNAME"):
        pg = dist.ProcessGroupGloo(store, spec.rank, spec.world, timeout)
    else:
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=spec.gloo_host)]
        opts._timeout = timeout  # forming the group: the peers may still be starting
        pg = dist.ProcessGroupGloo(store, spec.rank, spec.world, opts)
    if spec.collective_timeout_s > 0:
        pg.set_timeout(datetime.timedelta(seconds=spec.collective_timeout_s))
    return pg


class LazyGloo:
    """The gloo group for messages too large for shared memory, formed at the first one: every
    rank reaches that collective together (same model, same step), so they form it together.
    Until then no rank opens a socket (the slots are sized so that it normally never happens)."""

    def __init__(self, spec: WorkerSpec, store: dist.Store, timeout: datetime.timedelta):
        self._args = (spec, store, timeout)
        self._pg: dist.ProcessGroupGloo | None = None

    def allreduce(self, tensors: list[torch.Tensor]):
        if self._pg is None:
            self._pg = gloo_group(*self._args)
        return self._pg.allreduce(tensors)


def connect(spec: WorkerSpec, store: dist.Store, dtype: torch.dtype,
            timeout: datetime.timedelta, peers_alive: Callable[[], bool],
            segment: ShmCommunicator | None = None) -> Communicator:
    """This rank's communicator; every rank calls it once all ranks are started (it forms the
    process group through `store`). Rank 0 passes the segment from local_segment."""
    if on_gpu(spec.device):
        from backend.parallel.gpu_comm import GpuCommunicator
        return GpuCommunicator(spec.rank, spec.world, rank_device(spec.device, spec.rank), store,
                               dtype, timeout)
    if cpu_transport(spec) == "gloo":
        from backend.parallel.gloo_comm import GlooCommunicator
        return GlooCommunicator(gloo_group(spec, store, timeout), spec.rank, spec.world)
    fallback = LazyGloo(spec, store, timeout)
    if segment is None:
        return ShmCommunicator(spec.shm_name, spec.rank, spec.world, spec.slot_bytes, dtype,
                               create=False, fallback=fallback, peers_alive=peers_alive)
    segment._fallback = fallback
    return segment
