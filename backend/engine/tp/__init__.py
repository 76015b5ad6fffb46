"""Tensor-parallel process orchestration: starting the ranks of an engine and keeping them.

launch.py sizes and starts the group; group.py is rank 0's handle on its workers (start, step,
rebuild after a lost rank); worker.py is a rank's loop; node.py starts the ranks of another host
(`python -m backend.parallel.node`); channel.py is the authenticated step channel between hosts.
It sits above the model (a worker loads and runs one) and uses backend/parallel's communicators.
"""
