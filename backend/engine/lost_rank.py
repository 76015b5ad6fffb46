"""A failed tensor-parallel step, told to the requests it ends: which rank was lost, on which
host, and that the group is being rebuilt.

What fails first when a rank dies is a collective, and its exception speaks of the library's
internals (gloo's own source path and socket error, or the shared-memory communicator's
sequence number). A client can do nothing with those; the server log keeps them (the engine
loop logs the exception), and the requests get this module's message instead. Which rank is
gone is read from the group (a dead local worker, a remote rank's closed step channel) rather
than from the exception text: a killed process's sockets close one by one as it exits, so its
collective can fail a moment before its step channel reads as closed, hence the short wait.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Protocol

from backend.parallel.shm_comm import PeerLostError

# How long a failed step waits for the lost rank to show (its process reaped, its channel
# closed). Only a failed step waits, and only when nothing shows: a rank that is stuck, not dead.
LOST_RANK_WAIT_S = 2.0
_POLL_S = 0.05
# "[10.0.0.7]:41234" in a gloo socket error: the peer's address (the IP in brackets)
_GLOO_PEER = re.compile(r"\[([0-9A-Fa-f:.]+)\]:\d+")
# "[/path/to/file.cc:537]" and the like: a library's source location, never shown to a client
_SOURCE_REF = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|c|h|hpp|py):\d+\]\s*")
# what a failed collective's exception says (gloo through torch.distributed, or ours)
_COLLECTIVE_WORDS = ("gloo", "connection", "read error", "write error", "timed out", "timeout",
                     "peer", "socket", "broken pipe")


class Group(Protocol):
    """The part of backend.engine.tp.group.TPGroup this module reads."""
    world: int
    local_ranks: int
    step_failed: bool
    remote_hosts: dict[int, str]

    def lost_ranks(self) -> dict[int, str]: ...


@dataclass(frozen=True)
class LostRanks:
    """Ranks found gone (rank -> host) and whether the rebuild waits on other hosts."""
    ranks: dict[int, str]
    remote: bool  # the group has ranks on other hosts: its rebuild waits for their launchers

    def describe(self) -> str:
        """'tensor-parallel rank 1 (the worker on host 10.0.0.7) was lost', '... ranks 1 (the
        worker on host a) and 2 (the worker on host b) were lost', or '' when none is known."""
        parts = [f"{r} (the worker on host {h})" for r, h in sorted(self.ranks.items())]
        if not parts:
            return ""
        if len(parts) == 1:
            return f"tensor-parallel rank {parts[0]} was lost"
        return f"tensor-parallel ranks {', '.join(parts[:-1])} and {parts[-1]} were lost"


def find_lost(group: Group, exc: BaseException | None = None,
              wait_s: float = LOST_RANK_WAIT_S) -> LostRanks:
    """The ranks the group finds gone, polled for up to `wait_s`. If none shows (a rank stuck,
    or a host that vanished without closing its sockets), the peer address in a gloo error
    names the remote rank(s) that joined from that host (step_error names the host alone when
    none did)."""
    remote = group.local_ranks < group.world
    deadline = time.monotonic() + wait_s
    while True:
        lost = group.lost_ranks()
        if lost or time.monotonic() >= deadline:
            break
        time.sleep(_POLL_S)
    if not lost and exc is not None and (m := _GLOO_PEER.search(str(exc))):
        host = m.group(1)
        lost = {r: h for r, h in group.remote_hosts.items() if h == host}
    return LostRanks(dict(lost), remote)


def is_collective_failure(exc: BaseException) -> bool:
    """Whether `exc` is a collective's failure (a peer gone or silent), not rank 0's own."""
    if isinstance(exc, (PeerLostError, ConnectionError, TimeoutError)):
        return True
    name = type(exc).__name__
    text = str(exc).lower()
    return name.startswith("Dist") or any(w in text for w in _COLLECTIVE_WORDS)


def clean(text: str) -> str:
    """`text` without library source locations."""
    return _SOURCE_REF.sub("", text).strip()


def step_error(group: Group | None, exc: BaseException,
               wait_s: float = LOST_RANK_WAIT_S) -> tuple[str, LostRanks | None]:
    """(the error for the requests a failed step ends, the lost ranks or None). Without a
    tensor-parallel group, or when the step failed before any rank was involved, the step's
    own error as before."""
    if group is None or not group.step_failed:
        return f"engine step failed: {exc}", None
    lost = find_lost(group, exc, wait_s)
    rebuilt = "the tensor-parallel group is being rebuilt; retry the request"
    if lost.ranks:
        return f"{lost.describe()}; {rebuilt}", lost
    if is_collective_failure(exc):
        where = ""
        if (m := _GLOO_PEER.search(str(exc))) is not None:
            where = f" (its connection to host {m.group(1)} broke)"
        return f"a collective failed{where}: a rank stopped answering; {rebuilt}", lost
    return f"engine step failed: {clean(str(exc))}; {rebuilt}", lost


def rebuild_notice(lost: LostRanks | None) -> str | None:
    """Why new requests are refused while the group is rebuilt, or None to let them wait.

    Only a group with ranks on other hosts refuses: its rebuild waits until their launchers
    (or their pods) are back, for as long as that takes, so a request is better sent elsewhere
    at once. A one-host group restarts its own workers in seconds: requests wait for it."""
    if lost is None or not lost.remote:
        return None
    what = lost.describe() or "a tensor-parallel rank stopped answering"
    return (f"unavailable: {what}; the tensor-parallel group is being rebuilt; retry later or "
            "on another replica")
