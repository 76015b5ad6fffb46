"""Replica placement (backend/triton/placement.py): pure functions, no server, no GPU."""
import pytest

from backend.triton.placement import (
    PlacementError, compute_placement, count_visible_gpus, cuda_visible_devices,
    parse_gpu_device_ids, replica_index)

GROUP2 = [{"name": "llm_0", "count": 2, "kind": "KIND_MODEL"}]


def place(kind="KIND_MODEL", name="llm_0_0", groups=GROUP2, tp=1, ids="", gpus=4, device_id=0):
    return compute_placement(kind, device_id, name, groups, tp, ids, gpus)


def test_parse_gpu_device_ids():
    assert parse_gpu_device_ids("0,1;2,3") == [[0, 1], [2, 3]]
    assert parse_gpu_device_ids(" 3 ; 1 ") == [[3], [1]]
    assert parse_gpu_device_ids("") == [] and parse_gpu_device_ids(None) == []
    for bad in ("0,x", "0;;1", "-1", "0,0"):
        with pytest.raises(PlacementError, match="gpu_device_ids"):
            parse_gpu_device_ids(bad)


def test_replica_index_from_instance_names():
    assert replica_index("llm_0_1", GROUP2) == (1, 2)
    groups = [{"name": "a", "count": 2}, {"name": "b", "count": 3}]
    assert replica_index("b_2", groups) == (4, 5)
    assert replica_index("weird", groups) == (0, 5)


def test_cpu_is_default_and_needs_no_gpu():
    p = place(kind="KIND_CPU", gpus=0, tp=2)
    assert p.device == "cpu" and p.gpu_ids == () and "CPU" in p.describe()


def test_model_kind_consecutive_slices():
    assert place(name="llm_0_0", tp=2).gpu_ids == (0, 1)
    assert place(name="llm_0_1", tp=2).gpu_ids == (2, 3)


def test_model_kind_explicit_sets():
    assert place(name="llm_0_1", tp=2, ids="3,2;0,1").gpu_ids == (0, 1)
    assert place(name="llm_0_0", tp=2, ids="3,2;0,1").gpu_ids == (3, 2)


def test_gpu_kind_with_tp_is_refused_with_the_fix():
    with pytest.raises(PlacementError, match="KIND_MODEL.*gpu_device_ids"):
        place(kind="KIND_GPU", tp=2)
    assert place(kind="KIND_GPU", tp=1, device_id=3).gpu_ids == (3,)


@pytest.mark.parametrize("kw, match", [
    (dict(tp=2, ids="0,1;1,2"), "GPU 1 is in the sets of replicas 0 and 1"),
    (dict(tp=2, gpus=3), "need 4 GPUs but only 3"),
    (dict(tp=2, ids="0,1;4,5", gpus=6 - 2), "GPU 4 does not exist"),
    (dict(tp=2, ids="0,1"), "1 GPU set\\(s\\) for 2 replicas"),
    (dict(tp=2, ids="0,1;2"), "has 1 GPU\\(s\\) but tensor_parallel_size is 2"),
    (dict(gpus=0), "KIND_CPU"),
    (dict(kind="KIND_TPU"), "not supported"),
])
def test_misplacement_names_the_fix(kw, match):
    with pytest.raises(PlacementError, match=match):
        place(**kw)


def test_every_replica_reports_the_same_error():
    msgs = set()
    for name in ("llm_0_0", "llm_0_1"):
        with pytest.raises(PlacementError) as e:
            place(name=name, tp=2, ids="0,1;1,2")
        msgs.add(str(e.value))
    assert len(msgs) == 1


def test_visible_gpus_and_mask(tmp_path):
    assert count_visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == 2
    assert count_visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == 0
    (tmp_path / "0000:01").mkdir()
    (tmp_path / "0000:02").mkdir()
    assert count_visible_gpus({}, proc_dir=str(tmp_path)) == 2
    assert count_visible_gpus({}, proc_dir=str(tmp_path / "none")) == 0
    assert cuda_visible_devices((0, 1), {}) == "0,1"
    assert cuda_visible_devices((1,), {"CUDA_VISIBLE_DEVICES": "4,6"}) == "6"
