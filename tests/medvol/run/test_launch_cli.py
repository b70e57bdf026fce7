"""The launch paths users type: a Hydra sweep of DDP jobs, torchrun, and the one-line refusals."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from medvol.core.errors import MedvolError
from medvol.run.batch_arithmetic import scale_learning_rates
from medvol.run.launch import free_port
from medvol.run.training import run
from medvol.run.world import World, check_strategy, plan_world
from tests.ddp_support import explain, sweep_jobs, train_cli

SMALL = ["dataset.batch_size=1", "dataset.val_fraction=0.25", "callbacks.volume_slices=null"]


@pytest.mark.slow
def test_multirun_sweep_runs_each_job_on_two_ranks_in_one_sweep_dir(tmp_path):
    result = train_cli(
        ["-m", *SMALL, "strategy=ddp", "trainer.devices=2", "trainer.accelerator=cpu", "model.optimizer.lr=1e-3,3e-4"],
        cwd=tmp_path,
    )
    assert result.returncode == 0, explain(result)
    # Exactly one sweep and nothing else: no per-rank run dirs, no second sweep.
    assert [p.name for p in tmp_path.iterdir()] == ["outputs"]
    assert [p.name for p in (tmp_path / "outputs" / "vqgan").iterdir()] == ["multiruns"]
    (sweep,) = (tmp_path / "outputs" / "vqgan" / "multiruns").iterdir()
    jobs = sweep_jobs(sweep)
    assert sorted(jobs) == ["0", "1"]
    assert sorted(p.name for p in sweep.iterdir() if p.is_file()) == ["multirun.yaml", "summary.csv", "summary.md"]
    for job, lr in (("0", 1e-3), ("1", 3e-4)):
        summary = json.loads((jobs[job] / "summary.json").read_text())
        assert summary["world_size"] == 2
        assert "val/psnr" in summary["metrics"]
        assert (jobs[job] / "checkpoints" / "last.ckpt").is_file()
        config = OmegaConf.load(jobs[job] / ".hydra" / "config.yaml")
        assert config.model.optimizer.lr == lr
    assert result.stdout.count("medvol run summary (fit)") == 2


@pytest.mark.skipif(shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None, reason="no torchrun")
# torchrun's two ranks (~23 s each) run in the slow suite: the fast suite's 10 minutes on 2 cores.
@pytest.mark.slow
@pytest.mark.parametrize("flags", ["single-node", "multi-node"])
def test_torchrun_ranks_share_one_run_dir(tmp_path, flags):
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node=2"]
    if flags == "single-node":
        torchrun.append("--standalone")
    else:
        # The flags of a multi-node launch, with this machine as the only node.
        torchrun += ["--nnodes=1", "--node_rank=0", "--master_addr=127.0.0.1", f"--master_port={free_port()}"]
    result = train_cli(
        [*SMALL, "trainer.devices=2", "strategy=ddp", f"paths.log_dir={tmp_path / 'logs'}"],
        cwd=tmp_path,
        launcher=torchrun,
    )
    assert result.returncode == 0, explain(result)
    runs = list((tmp_path / "logs" / "vqgan" / "runs").iterdir())
    assert len(runs) == 1, f"ranks wrote {len(runs)} run dirs: {runs}"
    summary = json.loads((runs[0] / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert (runs[0] / "checkpoints" / "last.ckpt").is_file()


def test_dataparallel_is_refused_with_a_pointer_to_ddp(tiny_cfg):
    with pytest.raises(MedvolError, match=r"strategy=ddp trainer.devices=N"):
        run(tiny_cfg("strategy=dp"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_gpu_hardware_falls_back_to_one_cpu_process_without_a_gpu(tiny_cfg):
    cfg = tiny_cfg("hardware=gpu")
    assert plan_world(cfg.trainer) == World("cpu", 1, 1)
    assert cfg.trainer.precision == "32-true" and cfg.dataset.pin_memory is False
    with pytest.raises(MedvolError, match="no CUDA GPU is visible"):
        plan_world(tiny_cfg("hardware=a100x4").trainer)


def test_multinode_without_a_launcher_is_refused(tiny_cfg):
    cfg = tiny_cfg("trainer.num_nodes=2")
    with pytest.raises(MedvolError, match="srun"):
        check_strategy(cfg.strategy, plan_world(cfg.trainer))


@pytest.mark.parametrize(("rule", "factor"), [("none", 1.0), ("linear", 4.0), ("sqrt", 2.0)])
def test_lr_scaling_by_world_size(tiny_cfg, rule, factor):
    cfg = tiny_cfg()
    scaled, lines = scale_learning_rates(cfg.model, rule, world_size=4)
    assert scaled.optimizer.lr == pytest.approx(cfg.model.optimizer.lr * factor)
    assert cfg.model.optimizer.lr == 3e-4, "the composed config must stay as written"
    assert lines and lines[0].startswith("model.optimizer.lr: 0.0003")


def test_lr_scaling_rejects_unknown_rules(tiny_cfg):
    with pytest.raises(MedvolError, match="lr_scaling"):
        scale_learning_rates(tiny_cfg().model, "cubic", world_size=2)


@pytest.mark.slow  # 40 s of two-rank trials; the plain multirun sweep on two ranks stays in the fast suite
def test_optuna_sweep_runs_each_trial_on_two_ranks(tmp_path):
    sweep = tmp_path / "optuna"
    result = train_cli(
        ["-m", "hparams_search=optuna", *SMALL, "strategy=ddp", "trainer.devices=2",
         "hydra.sweeper.n_trials=2", "hydra.sweeper.sampler.n_startup_trials=2", f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path,
    )
    assert result.returncode == 0, explain(result)
    best = OmegaConf.load(sweep / "optimization_results.yaml")
    assert "model.optimizer.lr" in best.best_params and best.best_value > 0
    jobs = sweep_jobs(sweep)
    for job in ("0", "1"):
        assert json.loads((jobs[job] / "summary.json").read_text())["world_size"] == 2
    # The study's summary beside its trials, its best trial named last.
    assert (sweep / "summary.md").is_file() and "best job: " in result.stdout.strip().splitlines()[-1]


def test_a_launcher_world_that_differs_from_the_config_is_refused(tiny_cfg, monkeypatch):
    # torchrun --nproc_per_node=2 with trainer.devices=1 would otherwise train twice, alone, into one directory.
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(MedvolError, match="started 2 processes but the config asks for 1"):
        run(tiny_cfg())


def test_fsdp_on_the_cpu_is_refused_with_a_pointer_to_ddp(tiny_cfg):
    cfg = tiny_cfg("strategy=fsdp")
    with pytest.raises(MedvolError, match="use `strategy=ddp` on the CPU"):
        check_strategy(cfg.strategy, World("cpu", 2, 1))
