"""TensorFlow's thread pools sized to this rank's share of the cores, as OMP_NUM_THREADS sizes torch's.

TensorFlow sizes both of its pools (intra-op and inter-op) to the whole
machine and ignores OMP_NUM_THREADS, so N ranks on one host run N pools of
every core each (2 ranks on 2 cores: a small CNN's step took 5.7-11.5 ms so,
5.0-6.3 ms with a thread per pool; docs/keras.md). `hpdl launch` sets TensorFlow's
own variables for its ranks (`spawn.job_environment`); this covers
mpirun, srun and torchrun. The user's choice wins: TF_NUM_INTRAOP_THREADS
or TF_NUM_INTEROP_THREADS, or `tf.config.threading` set before `init`;
and a runtime that already started keeps its pools (they are fixed then).
"""

from __future__ import annotations

import os
from typing import Optional

import tensorflow as tf

from hpdl.runtime.spawn import TF_THREAD_VARIABLES, threads_per_rank

__all__ = ["share_cores"]


def share_cores(local_size: int) -> Optional[int]:
    """Give both pools this rank's share: OMP_NUM_THREADS, else the cores over the ranks of this host.

    Returns the size set, or None where the user's choice, one rank alone
    or an already running runtime leaves TensorFlow's own sizing.
    """
    if any(os.environ.get(name) for name in TF_THREAD_VARIABLES):
        return None
    threading = tf.config.threading
    if threading.get_intra_op_parallelism_threads() or threading.get_inter_op_parallelism_threads():
        return None
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) > 0:
        share = int(omp)
    elif local_size > 1:
        share = threads_per_rank(local_size)
    else:
        return None
    try:
        threading.set_intra_op_parallelism_threads(share)
        threading.set_inter_op_parallelism_threads(share)
    except RuntimeError:  # the runtime has started: its pools stay as they are
        return None
    return share
