"""Multi-host start-up: `jax.distributed` forms one global mesh over every process's devices.

Settings come from flags or the environment (INFIRE_COORDINATOR_ADDRESS, INFIRE_NUM_PROCESSES,
INFIRE_PROCESS_ID). It must run before anything touches a JAX device.
"""

from __future__ import annotations

import os


class DistributedConfigError(ValueError):
    pass


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
    """Joins the process group when a coordinator is named; returns whether it did."""
    address = coordinator_address or os.environ.get("INFIRE_COORDINATOR_ADDRESS")
    if not address:
        if num_processes not in (None, 1) or process_id not in (None, 0):
            raise DistributedConfigError("--num-processes/--process-id need --coordinator-address")
        return False
    n = num_processes if num_processes is not None else os.environ.get("INFIRE_NUM_PROCESSES")
    pid = process_id if process_id is not None else os.environ.get("INFIRE_PROCESS_ID")
    if n is None or pid is None:
        raise DistributedConfigError("a coordinator address needs the process count and this process's id")
    n, pid = int(n), int(pid)
    if n < 1 or not 0 <= pid < n:
        raise DistributedConfigError(f"process id {pid} is not in [0, {n})")
    import jax  # here: the commands that import this module's error (the router among them) need no jax

    jax.distributed.initialize(coordinator_address=address, num_processes=n, process_id=pid)
    return True
