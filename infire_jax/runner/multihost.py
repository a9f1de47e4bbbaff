"""One engine over several processes (jax.distributed): process 0 schedules, all run the steps.

Every jitted step is one SPMD program over the global mesh, so each process must launch the same
steps with the same inputs in the same order. The leader (process 0) sends each device command —
a small header, then the step's host arrays — with `broadcast_one_to_all`; followers loop on
receiving them. Warmup runs every broadcast shape once on all processes, so nothing compiles later.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

STEP, HISTORY, STOP, BURST = 1, 2, 3, 4


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def is_leader() -> bool:
    return jax.process_index() == 0


def _broadcast(tree: Any) -> Any:
    """The leader's values on every process, with the original dtypes (the psum widens bools)."""
    out = multihost_utils.broadcast_one_to_all(tree)
    return jax.tree.map(lambda got, like: np.asarray(got).astype(np.asarray(like).dtype), out, tree)


def send(command: int, arg: int, payload: Any = None) -> None:
    """Leader: announce a command, then ship its arrays."""
    _broadcast(np.array([command, arg], np.int32))
    if payload is not None:
        _broadcast(payload)


def receive_header() -> tuple[int, int]:
    header = _broadcast(np.zeros(2, np.int32))
    return int(header[0]), int(header[1])


def receive(template: Any) -> Any:
    """Follower: the leader's arrays, shaped like `template`."""
    return _broadcast(template)
