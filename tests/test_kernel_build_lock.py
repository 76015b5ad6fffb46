"""A build killed half-way leaves torch's lock file in the build dir; later loads must not wait
for it forever (kernels/cpu_ext.py holds a flock instead, which dies with its holder)."""
from __future__ import annotations

import subprocess
import sys

import kernels.cpu_ext as cpu_ext
from tests.required import no_cpu_kernels


def test_stale_torch_lock_does_not_block_a_load():
    if cpu_ext.load() is None:
        no_cpu_kernels()
    v = cpu_ext.selected_variant()
    stale = cpu_ext._cache_dir(v) / "lock"
    stale.touch()  # what a killed build leaves behind
    code = "import kernels.cpu_ext as c, sys; sys.exit(0 if c.load() is not None else 1)"
    # Without the flock, torch's FileBaton waits for the file to go away: the load never ends.
    done = subprocess.run([sys.executable, "-c", code], timeout=600, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not stale.exists()
