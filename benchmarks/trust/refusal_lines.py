"""Counts what a refused `python train.py` command prints, and the length of the default config print.

    .venv/bin/python benchmarks/trust/refusal_lines.py [--repo DIR]

Runs each refused command of issue 17 as a user would (a fresh temporary working directory,
`python train.py ...`) and prints a Markdown table: the command, its exit status, the lines it
printed (stdout and stderr together) and whether a run directory was left behind. Then the
default config print's line count at terminal widths 80 and 120. `--repo` measures another
checkout (e.g. main) with this environment's Python.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for a direct run
from benchmarks.common import ROOT, child_env  # noqa: E402

CONFIG_LINES = """
import sys
from pathlib import Path
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict
from rich.console import Console
import medvol.run.resolvers
from medvol.core.console import print_config_tree
with initialize_config_dir(version_base="1.3", config_dir=str(Path.cwd() / "conf"), job_name="train"):
    cfg = compose(config_name="train", return_hydra_config=True)
HydraConfig().set_config(cfg)
with open_dict(cfg):
    cfg.paths.output_dir = "/home/user/project/outputs/vqgan/runs/2026-01-01_00-00-00"
console = Console(record=True, width=int(sys.argv[1]), file=open("/dev/null", "w"))
print_config_tree(cfg, console)
print(len(console.export_text().splitlines()))
"""


def fixtures(work: Path, repo: Path) -> dict[str, list[str]]:
    """The refused commands, with the files they need written under `work`."""
    code = (
        "import sys, torch; from datamodules.sources.example_data import write_nifti_folder; "
        "torch.save({'state_dict': {}, 'loops': {}, 'epoch': 0, 'global_step': 0, "
        "'medvol_model': 'lightning_modules.discriminative.classifier.ClassifierModel'}, "
        "sys.argv[1] + '/foreign.ckpt'); "
        "write_nifti_folder(sys.argv[1] + '/scans', 4, 16)"
    )
    subprocess.run([sys.executable, "-c", code, str(work)], cwd=repo, check=True, env=child_env(repo, threads=1))
    (work / "corrupt.ckpt").write_bytes(os.urandom(2000))
    truncated = work / "scans" / "sub-001" / "ct.nii.gz"
    truncated.write_bytes(truncated.read_bytes()[:300])
    return {
        "missing `ckpt_path`": [f"ckpt_path={work / 'missing.ckpt'}"],
        "corrupt `ckpt_path`": [f"ckpt_path={work / 'corrupt.ckpt'}"],
        "foreign `ckpt_path` (a classifier's)": [f"ckpt_path={work / 'foreign.ckpt'}"],
        "`trainer.max_epochs=-5`": ["trainer.max_epochs=-5"],
        "`trainer.limit_train_batches=-1`": ["trainer.limit_train_batches=-1"],
        "`trainer.precision=bf17`": ["trainer.precision=bf17"],
        "data doctor refuses (a truncated file)": [
            "dataset=nifti",
            f"dataset.root={work / 'scans'}",
            "dataset.image_modalities=[ct]",
        ],
    }


def refused(repo: Path, args: list[str]) -> tuple[int, int, bool]:
    """(exit status, lines printed, whether a run directory was left) of `python train.py args`."""
    with tempfile.TemporaryDirectory() as cwd:
        done = subprocess.run(
            [sys.executable, str(repo / "train.py"), *args], cwd=cwd, env=child_env(repo, threads=1),
            capture_output=True, text=True,
        )
        left = any((Path(cwd) / "outputs").glob("*/runs/*"))
    return done.returncode, len((done.stdout + done.stderr).splitlines()), left


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=Path, default=ROOT)
    args = parser.parse_args()
    repo = args.repo.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        commands = fixtures(Path(tmp), repo)
        print(f"repo: {repo}\n\n| refused command | exit | lines printed | run directory left |\n|---|---|---|---|")
        for name, command in commands.items():
            status, lines, left = refused(repo, command)
            print(f"| {name} | {status} | {lines} | {'yes' if left else 'no'} |", flush=True)
    widths = {}
    for width in (80, 120):
        done = subprocess.run(
            [sys.executable, "-c", CONFIG_LINES, str(width)],
            cwd=repo,
            env=child_env(repo, threads=1),
            capture_output=True,
            text=True,
            check=True,
        )
        widths[width] = int(done.stdout.split()[-1])
    print(f"\ndefault config print: {widths[80]} lines at 80 columns, {widths[120]} at 120")


if __name__ == "__main__":
    main()
