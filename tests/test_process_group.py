"""A finished run leaves no process group behind for interpreter exit to tear down (where gloo aborts)."""

from __future__ import annotations

import torch.distributed as dist

from medvol.training import run


def test_a_successful_ddp_run_destroys_its_process_group(tiny_cfg):
    # One DDP rank still initialises a (gloo) process group, in this process.
    cfg = tiny_cfg("strategy=ddp", "trainer.devices=1", "trainer.max_epochs=1", "trainer.limit_train_batches=1",
                   "trainer.limit_val_batches=1", "callbacks.volume_slices=null")
    run(cfg)
    assert not dist.is_initialized(), "the run left its process group to interpreter exit"
