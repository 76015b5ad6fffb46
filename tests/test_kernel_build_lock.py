"""A build killed half-way leaves torch's lock file in the build dir; later loads must not wait
for it forever (tpllm_kernels/cpu_ext.py holds a flock instead, which dies with its holder)."""
from __future__ import annotations

import subprocess
import sys

import tpllm_kernels.cpu_ext as cpu_ext
from tests.required import no_cpu_kernels


def test_stale_torch_lock_does_not_block_a_load():
    if cpu_ext.load() is None:
        no_cpu_kernels()
    v = cpu_ext.selected_variant()
    stale = cpu_ext._cache_dir(v) / "lock"
    stale.touch()  # what a killed build leaves behind
    code = "import tpllm_kernels.cpu_ext as c, sys; sys.exit(0 if c.load() is not None else 1)"
    # Without the flock, torch's FileBaton waits for the file to go away: the load never ends.
    done = subprocess.run([sys.executable, "-c", code], timeout=600, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not stale.exists()


def test_cache_keys_do_not_change_after_a_build():
    """cpp_extension appends to the extra_ldflags list it is given; if that list were the
    module's own, every build would change the keys of the builds after it (make setup then
    built variants under keys no later process looks for, and rebuilt the selected one)."""
    if cpu_ext.load() is None:
        no_cpu_kernels()
    keys = lambda: {n: cpu_ext._cache_dir(cpu_ext._variant(n)) for n in cpu_ext.runnable()}  # noqa: E731
    before = keys()
    cpu_ext.build(cpu_ext.selected_variant().name)  # built already: ninja has nothing to do
    assert keys() == before
