"""Ending a rank's process group while the interpreter is still whole.

A gloo process group that is still alive when Python exits is torn down during interpreter
finalization. Its C++ worker threads may then drop the last reference to a tensor that holds
a Python object; releasing it needs the GIL, which a finalizing interpreter no longer hands
out, so the thread is ended inside a `noexcept` destructor and the process aborts (SIGABRT,
exit -6, "terminate called without an active exception") after a run that succeeded.
Lightning destroys only NCCL groups at exit, so medvol destroys the group itself: at exit,
from an `atexit` handler (which runs before finalization), once a run has succeeded.

Not at the end of `run()`: under torchrun or srun a Hydra sweep runs every job in the same
processes, and the next job reuses the group (its rendezvous store may be shared with the
launcher, where a second rendezvous would meet the first one's keys).
"""

from __future__ import annotations

import atexit

import torch.distributed as dist

_state = {"registered": False, "succeeded": False}


def release_process_group() -> None:
    """Destroy this process's default process group, if there is one.

    Only when every collective has completed on every rank: destroying a group while a peer
    still waits in a collective leaves that peer to its timeout.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _release_if_succeeded() -> None:
    # After a failed run a peer may still wait in a collective; the process exits non-zero anyway.
    if _state["succeeded"]:
        release_process_group()


def run_started() -> None:
    """A run begins: until it succeeds, exit leaves the process group alone."""
    _state["succeeded"] = False


def release_at_exit() -> None:
    """The run succeeded: destroy the process group when the process exits, before finalization."""
    _state["succeeded"] = True
    if not _state["registered"]:
        atexit.register(_release_if_succeeded)
        _state["registered"] = True
