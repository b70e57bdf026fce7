"""predict.py over a folder of many scans as a batch job (issue 63 item 10): a rerun skips the subjects already done,
`num_parts`/`part_id` split the subjects across processes, one log line per subject, and a damaged file is a failed
row of the summary while the others are written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from medvol.core.errors import MedvolError
from medvol.run.predict_batch import SubjectsFailed, job_part, part_positions
from medvol.run.predicting import predict
from medvol.volumes.prediction_writer import PredictionWriter
from tests.conftest import ROOT, compose_cfg, subprocess_env
from tests.medvol.run.test_predict import predict_cfg, saved_run, write_lps_scans


@pytest.fixture(scope="module")
def phantom_run(tmp_path_factory) -> Path:
    """A tiny VQ-GAN trained on the synthetic phantoms."""
    base = tmp_path_factory.mktemp("batch")
    return saved_run(base / "run", compose_cfg(base / "run", ["logger=none", "callbacks.volume_slices=null"]))


def batch_cfg(*overrides: str):
    """The predict config on the scans' own voxels (the phantoms' 6 mm would leave too few for the model's SSIM)."""
    return predict_cfg("spacing=native", *overrides)


def scan_folder(folder: Path, count: int) -> Path:
    """`<folder>/scan<k>.nii.gz`, `count` LPS int16 scans."""
    scans = write_lps_scans(folder.parent / f"{folder.name}-cases", count)
    folder.mkdir(parents=True)
    for k, path in enumerate(sorted(scans.glob("*/image.nii.gz"))):
        path.rename(folder / f"scan{k}.nii.gz")
    return folder


def written_subjects(monkeypatch) -> list[str]:
    """The subjects PredictionWriter.write is called for, in order, as it is called."""
    seen: list[str] = []
    real = PredictionWriter.write

    def write(self, outputs, batch):
        seen.extend(str(s) for s in batch["subject"])
        return real(self, outputs, batch)

    monkeypatch.setattr(PredictionWriter, "write", write)
    return seen


def test_parts_are_disjoint_cover_every_subject_and_do_not_depend_on_the_listing_order():
    subjects = [f"case{k:03d}" for k in range(103)]
    shuffled = subjects[::-1]
    for count in (1, 2, 7):
        shares = [[subjects[i] for i in part_positions(subjects, count, k)] for k in range(count)]
        assert sorted(s for share in shares for s in share) == subjects
        assert max(len(s) for s in shares) - min(len(s) for s in shares) <= 1
        # The same subjects listed in another order give every part the same subjects.
        assert [sorted(shuffled[i] for i in part_positions(shuffled, count, k)) for k in range(count)] == \
            [sorted(s) for s in shares]


def test_the_part_comes_from_the_command_else_from_torchrun(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert job_part(None, None) == (1, 0)
    assert job_part(4, 3) == (4, 3)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    # Left behind by a Trainer in this process: not torchrun's.
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert job_part(None, None) == (1, 0)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert job_part(None, None) == (2, 1)
    assert job_part(3, 0) == (3, 0)
    refused = [(2, 2, "part_id"), (0, 0, "num_parts"), (2, None, "part_id"), (None, 1, "num_parts"),
               (True, 0, "num_parts")]
    for num_parts, part_id, key in refused:
        with pytest.raises(MedvolError, match=f"`{key}`"):
            job_part(num_parts, part_id)


def test_predict_over_a_folder_resumes_where_it_stopped(phantom_run, tmp_path, monkeypatch):
    scans = scan_folder(tmp_path / "scans", 4)
    out = tmp_path / "out"
    cfg = batch_cfg(f"ckpt_path={phantom_run}/checkpoints/last.ckpt", f"input={scans}", f"output_dir={out}")
    real = PredictionWriter.write

    def killed_after_writing_scan2(self, outputs, batch):
        written = real(self, outputs, batch)
        if "scan2" in batch["subject"]:
            raise KeyboardInterrupt
        return written

    monkeypatch.setattr(PredictionWriter, "write", killed_after_writing_scan2)
    with pytest.raises(KeyboardInterrupt):
        predict(cfg)
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.nii.gz")}
    assert sorted(before) == [f"scan{k}_reconstruction.nii.gz" for k in range(3)]
    monkeypatch.setattr(PredictionWriter, "write", real)

    seen = written_subjects(monkeypatch)
    predict(cfg)
    # scan0 and scan1 were done: untouched; scan2's files were written but the job stopped before it was done.
    assert seen == ["scan2", "scan3"]
    for k in (0, 1):
        name = f"scan{k}_reconstruction.nii.gz"
        assert (out / name).stat().st_mtime_ns == before[name]
    assert sorted(p.name for p in out.glob("*.nii.gz")) == [f"scan{k}_reconstruction.nii.gz" for k in range(4)]
    # The table holds every subject, those of the first job too.
    assert [line.split(",")[0] for line in (out / "metrics.csv").read_text().splitlines()[1:]] == \
        [f"scan{k}" for k in range(4)]
    log = (out / "predict.log").read_text()
    assert "2 subject(s) of 4 already done in" in log
    assert "[1/2] scan2" in log and "[2/2] scan3" in log and "left" in log

    # A third run has nothing to do; continue_prediction=false predicts every subject again.
    seen.clear()
    predict(cfg)
    assert seen == []
    predict(batch_cfg(f"ckpt_path={phantom_run}/checkpoints/last.ckpt", f"input={scans}", f"output_dir={out}",
                        "continue_prediction=false"))
    assert seen == [f"scan{k}" for k in range(4)]


def test_a_deleted_output_or_another_checkpoint_is_predicted_again(phantom_run, tmp_path, monkeypatch):
    scans = scan_folder(tmp_path / "scans", 2)
    out = tmp_path / "out"
    cfg = batch_cfg(f"ckpt_path={phantom_run}/checkpoints/last.ckpt", f"input={scans}", f"output_dir={out}")
    predict(cfg)
    (out / "scan1_reconstruction.nii.gz").unlink()
    seen = written_subjects(monkeypatch)
    predict(cfg)
    assert seen == ["scan1"]
    # The same path holding another checkpoint (a run trained again): nothing is skipped.
    checkpoint = phantom_run / "checkpoints" / "last.ckpt"
    status = checkpoint.stat()
    os.utime(checkpoint, ns=(status.st_atime_ns, status.st_mtime_ns + 10**9))
    seen.clear()
    predict(cfg)
    assert seen == ["scan0", "scan1"]


def test_two_parts_write_every_subject_once_and_none_twice(phantom_run, tmp_path, monkeypatch):
    scans = scan_folder(tmp_path / "scans", 5)
    out = tmp_path / "out"
    seen = written_subjects(monkeypatch)
    shares = []
    for part in (0, 1):
        predict(batch_cfg(f"ckpt_path={phantom_run}/checkpoints/last.ckpt", f"input={scans}", f"output_dir={out}",
                            "num_parts=2", f"part_id={part}"))
        shares.append(list(seen))
        seen.clear()
    assert sorted(shares[0] + shares[1]) == [f"scan{k}" for k in range(5)]
    assert not set(shares[0]) & set(shares[1]) and shares[0] and shares[1]
    assert sorted(p.name for p in out.glob("*.nii.gz")) == [f"scan{k}_reconstruction.nii.gz" for k in range(5)]
    # The part that ends last writes the table of every subject done in the folder.
    assert len((out / "metrics.csv").read_text().splitlines()) == 6


def test_a_damaged_file_among_good_ones_is_a_failed_row_and_the_others_are_written(phantom_run, tmp_path):
    scans = scan_folder(tmp_path / "scans", 3)
    (scans / "broken.nii.gz").write_bytes(b"\x1f\x8b this is not a gzip stream" * 20)
    out = tmp_path / "out"
    with pytest.raises(SubjectsFailed) as failed:
        predict(batch_cfg(f"ckpt_path={phantom_run}/checkpoints/last.ckpt", f"input={scans}", f"output_dir={out}"))
    assert failed.value.exit_code == 3
    assert str(failed.value).startswith(f"1 of 4 subjects failed (broken); listed in {out / 'predict.log'}")
    assert sorted(p.name for p in out.glob("*.nii.gz")) == [f"scan{k}_reconstruction.nii.gz" for k in range(3)]
    log = (out / "predict.log").read_text()
    assert "predicted 3 of 4 subjects" in log
    failed_lines = [line for line in log.splitlines() if "failed: broken: " in line]
    assert len(failed_lines) == 1 and "broken.nii.gz" in failed_lines[0]


@pytest.mark.slow
def test_two_processes_of_a_slurm_array_and_a_damaged_file_exit_3(phantom_run, tmp_path):
    scans = scan_folder(tmp_path / "scans", 4)
    (scans / "broken.nii.gz").write_bytes(b"not a NIfTI file" * 40)
    out = tmp_path / "out"
    command = [sys.executable, str(ROOT / "predict.py"), f"ckpt_path={phantom_run}/checkpoints/last.ckpt",
               f"input={scans}", f"output_dir={out}", "device=cpu", "spacing=native", "num_parts=2"]
    jobs = [subprocess.Popen([*command, f"part_id={k}"], cwd=tmp_path, env=subprocess_env(), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for k in (0, 1)]
    results = [(job.wait(timeout=600), job.stderr.read()) for job in jobs]
    written = sorted(p.name for p in out.glob("*.nii.gz"))
    assert written == [f"scan{k}_reconstruction.nii.gz" for k in range(4)]
    codes = sorted(code for code, _ in results)
    # broken.nii.gz sorts first: part 0 holds it and says so in one line; part 1 ends well.
    assert codes == [0, 3]
    failing = next(err for code, err in results if code == 3)
    assert failing.strip().splitlines()[-1].startswith("medvol: error: 1 of 3 subjects failed (broken)")
