"""benchmarks/generation/generation_quality.py and benchmarks/generation/ldm.py --anatomy build the real sets they
measure from the config as train.py composes it, in a process of their own (train.py's resolvers registered by the
benchmark itself, not by anything a test imported before): the table from the command line, the anatomy sets in a fresh
interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NAMES = [f"BraTS2021_{k:05d}" for k in range(8)]


def split_file(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"seed": 0, "train": NAMES[:4], "val": NAMES[4:6], "test": NAMES[6:]}))
    return path


@pytest.mark.slow
def test_the_table_runs_from_the_command_line_and_the_collapsed_rows_score_worse_than_real_draws(tmp_path):
    pytest.importorskip("nilearn.datasets", reason="the MNI152 brains come from nilearn's wheel (the dev extra)")
    split_file(tmp_path / "ldm_cpu" / "split.json")
    script = ROOT / "benchmarks" / "generation" / "generation_quality.py"
    done = subprocess.run([sys.executable, str(script), "--out", str(tmp_path),
                           "--subjects", "8", "--spacing", "8", "8", "8", "--runs", "table"],
                          capture_output=True, text=True, cwd=ROOT, env={"OMP_NUM_THREADS": "1", "PATH": ""})
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line.split(" | ")[0].strip("| "): [float(v) for v in line.strip(" |").split(" | ")[1:]]
            for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line
            and not line.startswith("| set ")}
    real = rows["independent real draws (validation subjects)"]
    assert real[0] == 2  # volumes: the two validation subjects, each against the two test subjects
    # MMD (the first metric): the mean volume repeated and one volume repeated sit further from the test set.
    assert rows["collapsed: the training mean volume, repeated"][1] > real[1]
    assert rows["collapsed: one training volume, repeated"][1] > real[1]
    # The copy: every volume is a training volume (nearest-training correlation 1, closer than real 1).
    assert rows["a copy: training volumes given back"][4] == pytest.approx(1.0)
    assert rows["a copy: training volumes given back"][6] == pytest.approx(1.0)


@pytest.mark.slow
def test_the_anatomy_sets_are_the_whole_volume_runs_brains_in_a_fresh_process(tmp_path):
    pytest.importorskip("nilearn.datasets", reason="the MNI152 brains come from nilearn's wheel (the dev extra)")
    from datamodules.sources.brain_lesions import write_brain_lesions

    root = write_brain_lesions(tmp_path / "data", 8, (8.0, 8.0, 8.0))
    split = split_file(tmp_path / "split.json")
    common = [f"dataset.root={root}", "dataset.pattern='{subject}/{subject}_{modality}.nii.gz'",
              "dataset.image_modalities=[t1]", "dataset.transforms.spacing=[8.0,8.0,8.0]",
              "dataset.transforms.spatial_size=[24,24,24]", f"dataset.split_file={split}"]
    code = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); "
            "from benchmarks.generation import ldm; sets = ldm.anatomy_sets(Path(sys.argv[2]), sys.argv[3:]); "
            "print([tuple(s.shape) for s in sets])")
    done = subprocess.run([sys.executable, "-c", code, str(ROOT), str(tmp_path), *common], capture_output=True,
                          text=True, cwd=ROOT, env={"OMP_NUM_THREADS": "1", "PATH": ""})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == str([(4, 1, 24, 24, 24), (2, 1, 24, 24, 24), (2, 1, 24, 24, 24)])
