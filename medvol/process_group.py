"""Ending a rank's process group while the interpreter is still whole.

A gloo process group that is still alive when Python exits is torn down during interpreter
finalization. Its C++ worker threads may then drop the last reference to a tensor that holds
a Python object; releasing it needs the GIL, which a finalizing interpreter no longer hands
out, so the thread is ended inside a `noexcept` destructor and the process aborts (SIGABRT,
exit -6, "terminate called without an active exception") after a run that succeeded.
Lightning destroys only NCCL groups at exit, so medvol destroys the group itself once a run's
collectives are over.
"""

from __future__ import annotations

import torch.distributed as dist


def release_process_group() -> None:
    """Destroy this process's default process group, if there is one.

    Call it only when every collective of the run has completed on every rank (after a
    successful run): destroying a group while a peer still waits in a collective would leave
    that peer to its timeout.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
