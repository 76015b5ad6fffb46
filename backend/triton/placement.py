"""Where one Triton model instance (one engine replica) runs: pure functions, no torch, no Triton.

Rules (model_repository/README.md, Placement):
- KIND_CPU: the replica runs on CPU (tensor parallelism across CPU worker processes).
- KIND_GPU: Triton picks one GPU per instance, so only tensor_parallel_size 1 is allowed.
- KIND_MODEL: this backend places the replica itself: replica i gets the i-th set of
  `gpu_device_ids` ("0,1;2,3") or, when that parameter is empty, GPUs [i*tp, (i+1)*tp).
Every misplacement (overlap, too few GPUs, wrong set size) is a load error that says what to write.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path


class PlacementError(ValueError):
    """A load error: the model config places this replica impossibly; the message names the fix."""


@dataclass(frozen=True)
class Placement:
    device: str  # "cpu" or "cuda"
    gpu_ids: tuple[int, ...] = field(default_factory=tuple)  # physical ids (of the visible list)
    replica_index: int = 0
    num_replicas: int = 1

    def describe(self) -> str:
        where = "CPU" if self.device == "cpu" else "GPUs " + ",".join(map(str, self.gpu_ids))
        return f"replica {self.replica_index + 1}/{self.num_replicas} on {where}"


def parse_gpu_device_ids(text: str | None) -> list[list[int]]:
    """ "0,1;2,3" -> [[0, 1], [2, 3]]; "" or None -> []."""
    text = (text or "").strip()
    if not text:
        return []
    sets = []
    for part in text.split(";"):
        part = part.strip()
        if not part:
            raise PlacementError(f"gpu_device_ids: empty GPU set in {text!r}; write e.g. \"0,1;2,3\"")
        try:
            ids = [int(x) for x in part.split(",")]
        except ValueError:
            raise PlacementError(f"gpu_device_ids: {part!r} is not a comma-separated list of GPU "
                                 "ids; write e.g. \"0,1;2,3\" (one set per replica)") from None
        if any(i < 0 for i in ids):
            raise PlacementError(f"gpu_device_ids: GPU ids must be >= 0, got {part!r}")
        if len(set(ids)) != len(ids):
            raise PlacementError(f"gpu_device_ids: GPU set {part!r} repeats a GPU")
        sets.append(ids)
    return sets


def replica_index(instance_name: str, instance_groups: list[dict]) -> tuple[int, int]:
    """(index of this instance among all instances of the model, total instance count).

    Triton names instances "<group name>_<i>" (the group name defaults to "<model>_<group index>").
    """
    counts = [int(g.get("count", 1)) for g in instance_groups] or [1]
    total = sum(counts)
    m = re.match(r"^(.*)_(\d+)$", instance_name or "")
    if not m:
        return 0, total
    prefix, idx = m.group(1), int(m.group(2))
    offset = 0
    for g, n in zip(instance_groups, counts):
        if g.get("name") == prefix:
            return offset + idx, total
        offset += n
    return idx, total


def count_visible_gpus(env: dict | None = None, proc_dir: str = "/proc/driver/nvidia/gpus") -> int:
    """GPUs this process could use, without initializing CUDA (so CUDA_VISIBLE_DEVICES can still
    be narrowed per replica afterwards)."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([v for v in visible.split(",") if v.strip() and v.strip() != "-1"])
    p = Path(proc_dir)
    return len(list(p.iterdir())) if p.is_dir() else 0


def compute_placement(kind: str, device_id: int, instance_name: str, instance_groups: list[dict],
                      tensor_parallel_size: int, gpu_device_ids: str | None,
                      num_gpus: int) -> Placement:
    """This replica's device and GPU set; raises PlacementError (naming the fix) when impossible."""
    kind = kind.upper().removeprefix("KIND_")
    tp = tensor_parallel_size
    if tp < 1:
        raise PlacementError(f"tensor_parallel_size: must be >= 1, got {tp}")
    index, total = replica_index(instance_name, instance_groups)
    if kind == "CPU":
        return Placement("cpu", (), index, total)
    if kind == "GPU":
        if tp > 1:
            raise PlacementError(
                f"instance_group kind KIND_GPU places each instance on one GPU, but "
                f"tensor_parallel_size is {tp}: use `instance_group [{{ count: N, kind: KIND_MODEL }}]` "
                f"with parameter gpu_device_ids (e.g. \"0,1;2,3\"), or leave gpu_device_ids empty "
                f"for consecutive slices of {tp} GPUs per replica")
        if num_gpus and device_id >= num_gpus:
            raise PlacementError(f"instance_group: GPU {device_id} requested but only {num_gpus} "
                                 f"visible; list existing GPUs in `gpus: [...]`")
        return Placement("cuda", (device_id,), index, total)
    if kind != "MODEL":
        raise PlacementError(f"instance_group kind: {kind!r} is not supported; use KIND_CPU, "
                             "KIND_GPU (tensor_parallel_size 1) or KIND_MODEL")
    if num_gpus == 0:
        raise PlacementError("instance_group kind KIND_MODEL places replicas on GPUs but no GPU is "
                             "visible; use `kind: KIND_CPU` to run on CPU")
    gpu_sets = gpu_sets_for(total, tp, gpu_device_ids, num_gpus)
    return Placement("cuda", tuple(gpu_sets[index]), index, total)


def engine_device(placement: Placement, requested: str | None = None) -> str:
    """The engine's `device` setting for this replica. The instance kind decides (KIND_CPU ->
    "cpu"; KIND_GPU / KIND_MODEL -> "cuda", i.e. the replica's first GPU once
    CUDA_VISIBLE_DEVICES exposes only its set); a `device` parameter may only agree with it."""
    requested = (requested or "auto").strip().lower()
    if requested in ("auto", placement.device):
        return placement.device
    if placement.device == "cuda" and requested.startswith("cuda:"):
        raise PlacementError(f"parameter device: {requested!r} names a GPU, but this replica's "
                             "GPUs come from the instance group; write device \"cuda\" (or "
                             "leave it empty) and choose GPUs with gpu_device_ids or `gpus: [...]`")
    kind = "KIND_CPU" if placement.device == "cpu" else "KIND_GPU/KIND_MODEL"
    fix = "kind: KIND_MODEL (or KIND_GPU)" if requested.startswith("cuda") else "kind: KIND_CPU"
    raise PlacementError(f"parameter device: {requested!r} contradicts instance_group kind "
                         f"{kind} (device {placement.device!r}); use `{fix}` or leave device empty")


def gpu_sets_for(num_replicas: int, tp: int, gpu_device_ids: str | None,
                 num_gpus: int) -> list[list[int]]:
    """The GPU set of every replica, validated as a whole (so every replica reports the same error)."""
    sets = parse_gpu_device_ids(gpu_device_ids)
    if not sets:
        need = num_replicas * tp
        if need > num_gpus:
            raise PlacementError(
                f"instance_group: {num_replicas} replica(s) x tensor_parallel_size {tp} need {need} "
                f"GPUs but only {num_gpus} are visible; lower `count` or tensor_parallel_size")
        return [list(range(i * tp, (i + 1) * tp)) for i in range(num_replicas)]
    if len(sets) < num_replicas:
        raise PlacementError(
            f"gpu_device_ids: {len(sets)} GPU set(s) for {num_replicas} replicas; write one set per "
            f"replica separated by ';' (e.g. \"0,1;2,3\") or lower `count` to {len(sets)}")
    for i, s in enumerate(sets):
        if len(s) != tp:
            raise PlacementError(
                f"gpu_device_ids: set {i} ({','.join(map(str, s))}) has {len(s)} GPU(s) but "
                f"tensor_parallel_size is {tp}; give each replica exactly {tp} GPUs")
    seen: dict[int, int] = {}
    for i, s in enumerate(sets[:num_replicas]):
        for g in s:
            if g in seen:
                raise PlacementError(
                    f"gpu_device_ids: GPU {g} is in the sets of replicas {seen[g]} and {i}; "
                    "replicas must not share GPUs")
            seen[g] = i
            if g >= num_gpus:
                raise PlacementError(f"gpu_device_ids: GPU {g} does not exist ({num_gpus} visible: "
                                     f"0..{num_gpus - 1}); use ids below {num_gpus}")
    return sets[:num_replicas]


def cuda_visible_devices(gpu_ids: tuple[int, ...], env: dict | None = None) -> str:
    """The CUDA_VISIBLE_DEVICES value that exposes exactly `gpu_ids` (indices into any existing
    CUDA_VISIBLE_DEVICES list, as Triton and torch number them)."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return ",".join(map(str, gpu_ids))
    base = [v.strip() for v in visible.split(",") if v.strip()]
    return ",".join(base[i] for i in gpu_ids)
