"""Where the documented commands run: a folder per guide holding what its commands name, made at toy size.

A guide's commands run in order in one working folder (later commands use what earlier ones wrote, as a reader's
do), holding links to the entry points, `conf/`, the Makefile and the venv. What a command names but does not make
comes from here:

- absolute paths: `/data/...` and `/models/...` are example data written once per session in the layout the
  commands name (`DATA`); `/tmp/...` is a folder inside the working folder;
- `CKPT`, `DDPM_CKPT`, `SURVIVAL_CKPT`, `DIR`: per guide (`WORLDS`), a checkpoint of a documented training command
  run at toy size, or an example data folder;
- `<stamp>`, `<run>`, `<vqgan-run>`, ...: what the reader would look up, the newest match in the working folder
  (`<X-run>`: of a run whose model is X);
- input folders and files (`scans/`, `scan.nii.gz`, `t1_scans/`) per guide, made for its checkpoints.

Toy size: keys appended to a training command that the command did not type (`toy_overrides`): one epoch of two
batches, small phantoms and crops, the tiny networks of `tests/conftest.py`. Nothing the guide typed is replaced.
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

import medvol.run.resolvers  # noqa: F401 - the configs use medvol's resolvers
from datamodules.sources.example_data import write_brats, write_mace_csv, write_nifti_folder
from datamodules.sources.phantom import make_phantom, phantom_affine
from tests.conftest import CONF_DIR, TINY_MODEL, subprocess_env
from tests.doc_commands import ROOT, Command

VENV_BIN = Path(sys.executable).parent
# What the working folder links to: what a reader has in the repository.
LINKED = ("train.py", "predict.py", "check_data.py", "export.py", "conf", "Makefile", "pyproject.toml", ".venv",
          "benchmarks", "tests", "README.md", "docs")
ABSOLUTE = re.compile(r"(?<=[=\s'\"])/(data|models|tmp)(?=/|\s|$|['\"])")
TOKENS = ("DDPM_CKPT", "SURVIVAL_CKPT", "CKPT", "DIR")
TOKEN = re.compile(r"(?<=[=\s])(" + "|".join(TOKENS) + r")(?=[\s/]|$)")
LOOKUP = re.compile(r"<([a-z][a-z-]*)>")
COMMAND_TIMEOUT = 900


# Example data -------------------------------------------------------------------------------------------------


def brats_t1_only(path: Path) -> None:
    write_brats(path, 4, 2021, 24)
    for case in path.iterdir():
        for scan in case.iterdir():
            if not scan.name.endswith("_t1.nii.gz"):
                scan.unlink()


def flat_ct(path: Path, subjects: int = 6, size: int = 24) -> None:
    """`<path>/case<i>.nii.gz`: CT phantoms in HU, one file per subject (`pattern="{subject}.nii.gz"`)."""
    path.mkdir(parents=True)
    shape = (size,) * 3
    for i in range(subjects):
        nib.save(nib.Nifti1Image(make_phantom(0, i, shape).channels["ct"], phantom_affine(shape, 8.0)),
                 str(path / f"case{i}.nii.gz"))


def ct_list(path: Path) -> None:
    """A list file (`subject`, `ct` columns) beside the scans it names."""
    flat_ct(path.parent / "list_scans")
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["subject", "ct"])
        writer.writerows([[f"case{i}", f"list_scans/case{i}.nii.gz"] for i in range(6)])


def mace_table(name: str) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        table = write_mace_csv(path.parent / f"{path.stem}_files", 12, 24)
        shutil.move(str(table), str(path))
        with path.open() as handle:
            rows = list(csv.DictReader(handle))
        for row in rows:
            row["image"] = f"{path.stem}_files/{row['image']}"
        with path.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)

    return write


def hippocampus(path: Path) -> None:
    """An nnU-Net raw dataset of two labelled structures, with imagesTs for predict."""
    from benchmarks.segmentation.nnunet_plans import write_raw

    rng = np.random.default_rng(0)
    cases = {}
    for i in range(6):
        label = np.zeros((20, 18, 16), np.uint8)
        label[5:12, 4:10, 3:9] = 1
        label[12:15, 6:9, 5:9] = 2
        image = rng.normal(100, 5, label.shape).astype(np.float32) + 40 * label
        cases[f"hippocampus_{i:03d}"] = ([image], label, [1.0, 1.0, 1.0])
    write_raw(path.parent, path.name, ["MRI"], {"background": 0, "Anterior": 1, "Posterior": 2}, cases)
    (path / "imagesTs").mkdir()
    for i in range(2):
        shutil.copy(path / "imagesTr" / f"hippocampus_{i:03d}_0000.nii.gz", path / "imagesTs")


def decathlon(path: Path) -> None:
    """A Medical Segmentation Decathlon task: 4D images (channels on the last axis), labels value -> name."""
    import json

    (path / "imagesTr").mkdir(parents=True)
    (path / "labelsTr").mkdir()
    training = []
    for i in range(6):
        phantom = make_phantom(0, i, (24, 24, 24))
        image = np.stack([phantom.channels[m] * 1000 for m in ("flair", "t1", "t1ce", "t2")], -1)
        affine = phantom_affine((24, 24, 24), 2.0)
        nib.save(nib.Nifti1Image(image.astype(np.float32), affine), str(path / "imagesTr" / f"BRATS_{i:03d}.nii.gz"))
        nib.save(nib.Nifti1Image(phantom.label, affine), str(path / "labelsTr" / f"BRATS_{i:03d}.nii.gz"))
        training.append({"image": f"./imagesTr/BRATS_{i:03d}.nii.gz", "label": f"./labelsTr/BRATS_{i:03d}.nii.gz"})
    (path / "dataset.json").write_text(json.dumps({
        "name": "BrainTumour", "modality": {"0": "FLAIR", "1": "T1w", "2": "t1gd", "3": "T2w"},
        "labels": {"0": "background", "1": "necrotic core", "2": "oedema"}, "numTraining": 6, "training": training,
        "test": [],
    }))


def dicom_series(folder: Path, seed: int, description: str = "t1") -> None:
    """A T1-like phantom of 30 x 30 x 24 voxels of 3.2 x 3.2 x 4 mm (a head's extent) as an axial MR series."""
    from tests.dicom_series import write_series

    values = np.rint(make_phantom(0, seed, (30, 30, 24)).channels["t1"] * 1000).astype(np.int16)
    write_series(folder, values.transpose(1, 0, 2), spacing=(3.2, 3.2), step=4.0, origin=(-48.0, -48.0, -48.0),
                 description=description, seed=seed, modality="MR")


def dicom_one(path: Path) -> None:
    dicom_series(path, 1)


def dicom_studies(path: Path) -> None:
    for i in range(2):
        dicom_series(path / f"anon{i:04d}", 2 + i)


def dicom_two_series(path: Path) -> None:
    """One folder holding two series, told apart by SeriesDescription."""
    dicom_series(path, 4, "t1_mprage_sag")
    dicom_series(path, 5, "localizer_3plane")


def dicom_cases(path: Path) -> None:
    """`<subject>/image/`: a DICOM series where `{subject}/{modality}.nii.gz` would be."""
    for i in range(6):
        dicom_series(path / f"case{i:02d}" / "image", 10 + i)


def brats_dicom(path: Path) -> None:
    """BraTS 2023 case folders whose modalities are DICOM series folders (`<case>/<case>-t1n/`)."""
    from tests.dicom_series import write_series

    write_brats(path, 4, 2023, 24)
    for scan in sorted(path.glob("*/*.nii.gz")):
        image = nib.load(str(scan))
        # The series runs along LPS: the RAS phantom's x and y the other way, and the segmentation is stored so too
        # (on the series' voxel grid, as an export beside the series would be).
        values = np.asarray(image.dataobj)[::-1, ::-1]
        if scan.name.endswith("-seg.nii.gz"):
            lps = np.diag([-1.0, -1.0, 1.0, 1.0])
            lps[:3, 3] = [11.5, 11.5, -11.5]
            nib.save(nib.Nifti1Image(np.ascontiguousarray(values), lps), str(scan))
            continue
        stored = np.rint(values).astype(np.int16).transpose(1, 0, 2)
        write_series(scan.parent / scan.name.removesuffix(".nii.gz"), stored,
                     spacing=(1.0, 1.0), step=1.0, origin=(-11.5, -11.5, -11.5), modality="MR",
                     seed=len(scan.name))
        scan.unlink()


def perceptual_net(path: Path) -> None:
    """A local TorchScript 2D feature network (3 channels in), as `model.perceptual_model_path` takes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 3, padding=1))
    torch.jit.save(torch.jit.script(net), str(path))


# The example data the guides' absolute paths name, by path.
DATA: dict[str, Callable[[Path], Any]] = {
    "/data/BraTS2023": lambda p: write_brats(p, 6, 2023, 24),
    "/data/BraTS2021": lambda p: write_brats(p, 6, 2021, 24),
    "/data/brats": lambda p: write_brats(p, 6, 2021, 24),
    "/data/t1_only": brats_t1_only,
    "/data/brats_dicom": brats_dicom,
    "/data/ct": flat_ct,
    "/data/ctpa": flat_ct,
    "/data/mr": lambda p: write_nifti_folder(p, 6, 24, modalities=("t1", "t2"), label=True),
    "/data/list.csv": ct_list,
    "/data/nnUNet_raw/Dataset004_Hippocampus": hippocampus,
    "/data/Task01_BrainTumour": decathlon,
    "/data/mace/dataset.csv": mace_table("dataset"),
    "/data/table.csv": mace_table("table"),
    "/data/anon0042/ct": dicom_one,
    "/data/anon0057": dicom_two_series,
    "/data/studies": dicom_studies,
    "/data/cases": dicom_cases,
    "/models/features.pt": perceptual_net,
}


# Inputs a guide's predict commands read ---------------------------------------------------------------------


def brats_4d(source: str, cases: int = 2) -> Callable[[Path, Path], None]:
    """Each of the first `cases` BraTS cases of `source` as one 4D file, the four modalities on its last axis."""

    def write(path: Path, data: Path) -> None:
        root = data / source.removeprefix("/")
        path.mkdir(parents=True)
        for case in sorted(p for p in root.iterdir() if p.is_dir())[:cases]:
            files = {f.name.removeprefix(case.name).removesuffix(".nii.gz").strip("_-"): f for f in case.iterdir()}
            order = [next(files[n] for n in names if n in files)
                     for names in (("t1", "t1n"), ("t1ce", "t1c"), ("t2", "t2w"), ("flair", "t2f"))]
            volumes = [nib.load(str(f)) for f in order]
            stacked = np.stack([np.asarray(v.dataobj) for v in volumes], -1)
            nib.save(nib.Nifti1Image(stacked, volumes[0].affine), str(path / f"{case.name}.nii.gz"))

    return write


def phantom_scans(modality: str = "t1", covariates: bool = False) -> Callable[[Path, Path], None]:
    """Two phantom scans of `modality` (and `covariates.csv` for a model trained with age and sex)."""

    def write(path: Path, data: Path) -> None:
        path.mkdir(parents=True)
        shape = (24, 24, 24)
        for i in range(2):
            volume = make_phantom(0, 20 + i, shape).channels[modality] * (1 if modality == "ct" else 1000)
            nib.save(nib.Nifti1Image(volume.astype(np.float32), phantom_affine(shape, 6.0)),
                     str(path / f"patient{i}.nii.gz"))
        if covariates:
            (path / "covariates.csv").write_text("subject,age,sex\npatient0,61,0\npatient1,72,1\n")

    return write


def one_scan(path: Path, data: Path) -> None:
    shape = (24, 24, 24)
    volume = make_phantom(0, 30, shape).channels["t1"] * 1000
    nib.save(nib.Nifti1Image(volume.astype(np.float32), phantom_affine(shape, 6.0)), str(path))


# Per guide: what its tokens stand for (a documented training command whose checkpoint it is, or a data folder), and
# the inputs its commands read. A guide whose commands name nothing of these needs no entry.
WORLDS: dict[str, dict[str, Any]] = {
    "README.md": {"inputs": {"scans": brats_4d("/data/BraTS2023")}},
    "docs/predict.md": {
        "CKPT": "python train.py",
        "DDPM_CKPT": "python train.py model=ddpm",
        "SURVIVAL_CKPT": "python train.py model=survival dataset=csv dataset.csv_path=/data/mace/dataset.csv "
                         "dataset.covariate_columns=[age,sex]",
        "inputs": {"scan.nii.gz": one_scan, "scans": phantom_scans("ct", covariates=True),
                   "t1_scans": phantom_scans("t1")},
    },
    "docs/export.md": {
        "CKPT": "python train.py model=segmentation dataset=brats dataset.root=/data/BraTS2021",
        "inputs": {"scans": brats_4d("/data/BraTS2021")},
    },
    "docs/dicom.md": {"CKPT": "python train.py"},
    "docs/reliability.md": {"CKPT": "python train.py"},
    "docs/segmentation.md": {
        "CKPT": "python train.py model=segmentation dataset=nnunet "
                "dataset.root=/data/nnUNet_raw/Dataset004_Hippocampus",
        "DIR": "/data/BraTS2021",
        "inputs": {"scans": brats_4d("/data/BraTS2021")},
    },
    "docs/ldm.md": {"DIR": "/data/BraTS2021", "inputs": {"t1_scans": phantom_scans("t1")}},
}
# A guide whose `<stamp>` names a run it does not train itself: the token whose run stands there.
RUN_OF_STAMP = {"docs/export.md": "CKPT", "docs/reliability.md": "CKPT", "docs/predict.md": "CKPT"}


# Toy size ------------------------------------------------------------------------------------------------------


def model_families() -> dict[str, str]:
    """Model class path -> the family name of `conf/model/<name>.yaml` (the keys of TINY_MODEL)."""
    return {str(OmegaConf.load(p)["_target_"]): p.stem for p in (CONF_DIR / "model").glob("*.yaml")}


def composed(config_name: str, overrides: list[str]) -> DictConfig:
    """The config a command composes (its sweeps at their first value), with Hydra's node."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    single = []
    for override in parsed:
        text = override.input_line
        if override.is_sweep_override():
            text = f"{override.get_key_element()}={next(iter(override.sweep_string_iterator()))}"
        single.append(text)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR), job_name=config_name):
            return compose(config_name=config_name, overrides=single, return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()


def typed_keys(overrides: list[str]) -> set[str]:
    return {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o}


def has(cfg: DictConfig, key: str) -> bool:
    return OmegaConf.select(cfg, key, default="<absent>", throw_on_missing=False) != "<absent>"


def toy_overrides(overrides: list[str]) -> list[str]:
    """The keys appended to a train.py command for toy size: those its config has and the command did not type."""
    typed = typed_keys(overrides)
    cfg = composed("train", overrides)
    families = model_families()
    resumed = any(o.startswith("ckpt_path=") for o in overrides)
    candidates = [
        "trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1",
        "trainer.limit_test_batches=2", "trainer.num_sanity_val_steps=0",
    ]
    if not resumed:
        # A resumed or re-tested run keeps its own size (its checkpoint's networks).
        family = families.get(str(cfg.model.get("_target_")))
        # The radiographs a guide writes for predict.py are example_data's 32x32: the model keeps its preset's size.
        candidates += [
            *(o for o in TINY_MODEL.get(family, []) if not o.startswith("dataset.xray_size")),
            # 16 phantoms: two validation subjects, one for each of two DDP ranks.
            "dataset.num_subjects=16", "dataset.size=16",
            "dataset.patch_size=[16,16,16]", "dataset.stride=[16,16,16]", "dataset.patches_per_volume=2",
            "model.plan.iterations_per_epoch=2", "model.plan.base_features=4", "hydra.sweeper.n_trials=2",
        ]
        if cfg.dataset.get("transforms") is not None and cfg.dataset.transforms.get("spatial_size") is not None:
            candidates.append("dataset.transforms.spatial_size=[16,16,16]")
        if int(cfg.dataset.get("batch_size") or 1) > 2:
            # A preset's batch for hundreds of subjects (experiment=survival_synthetic: 16).
            candidates.append("dataset.batch_size=2")
        if (cfg.model.get("plan") or {}).get("patch_size") is not None:
            # A preset's fixed patch (experiment=brats_segmentation: 128^3, sized for a GPU).
            candidates.append("model.plan.patch_size=[16,16,16]")
        for stage, node in (cfg.get("cascade") or {}).items():
            if not str(stage).startswith("stage") or not isinstance(node, DictConfig):
                continue
            candidates.append(f"cascade.{stage}.trainer.max_epochs=1")
            stage_family = families.get(str((node.get("model") or {}).get("_target_")))
            if stage_family and stage_family != family:
                candidates += [f"cascade.{stage}.{o}" for o in TINY_MODEL.get(stage_family, [])]
            for key in ("patch_size", "stride"):
                candidates.append(f"cascade.{stage}.dataset.{key}=[16,16,16]")
    chosen = []
    for candidate in candidates:
        key = candidate.split("=", 1)[0]
        if key in typed or any(t.startswith(f"{key}.") for t in typed) or not has(cfg, key):
            continue
        if key.startswith("model.") and f"cascade.stage1.{key}" in typed:
            continue
        chosen.append(candidate)
    return chosen


# The working folder --------------------------------------------------------------------------------------------


class Sandbox:
    """A guide's working folder: links to the repository, its world made, its commands run in order."""

    def __init__(self, guide: str, folder: Path, cache: Path) -> None:
        self.guide, self.cwd, self.cache = guide, folder, cache
        self.cwd.mkdir(parents=True)
        for name in LINKED:
            (self.cwd / name).symlink_to(ROOT / name)
        self.world = WORLDS.get(guide, {})
        self.bound: dict[str, str] = {}
        self.ran: set[str] = set()

    def env(self) -> dict[str, str]:
        return subprocess_env(OMP_NUM_THREADS="1", PATH=f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
                              PYTHONUNBUFFERED="1")

    def data(self, absolute: str) -> Path:
        """The example data standing at an absolute path the guide names, written once per session."""
        path = self.cache / "abs" / absolute.removeprefix("/")
        maker = DATA.get(absolute)
        if maker is None:
            return path
        done = path.parent / f".{path.name}.done"
        if not done.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            maker(path)
            done.touch()
        return path

    def absolute(self, match: re.Match) -> str:
        root = match.group(1)
        if root == "tmp":
            (self.cwd / "tmp").mkdir(exist_ok=True)
            return str(self.cwd / "tmp")
        return str(self.cache / "abs" / root)

    def prepare(self, text: str) -> None:
        """Make the example data, checkpoints and inputs `text` names."""
        for path in DATA:
            if re.search(re.escape(path) + r"(?=/|\s|$|['\"])", text):
                self.data(path)
        for name, make in self.world.get("inputs", {}).items():
            target = self.cwd / name
            if re.search(r"(?<=[=\s])" + re.escape(name) + r"(?=/|\s|$)", text) and not target.exists():
                make(target, self.cache / "abs")
        for token in TOKENS:
            if re.search(r"(?<=[=\s])" + token + r"(?=[\s/]|$)", text) and token not in self.bound:
                self.bind(token)
        if "<stamp>" in text and self.guide in RUN_OF_STAMP and RUN_OF_STAMP[self.guide] not in self.bound:
            self.bind(RUN_OF_STAMP[self.guide])

    def bind(self, token: str) -> None:
        value = self.world.get(token)
        if value is None:
            raise AssertionError(f"{self.guide}: `{token}` stands for nothing here; add it to WORLDS in "
                                 "tests/doc_world.py")
        if value.startswith("/"):
            self.bound[token] = str(self.data(value))
            return
        run = trained_run(value, self.cache)
        relative = run.relative_to(run.parents[3])  # outputs/<family>/runs/<stamp>
        target = self.cwd / (relative if token == "CKPT" else Path("bound") / token / relative.name)
        if not target.exists():
            shutil.copytree(run, target, symlinks=True)
        self.bound[token] = str((target / "checkpoints" / "last.ckpt").relative_to(self.cwd)) \
            if token.endswith("CKPT") else str(target.relative_to(self.cwd))

    def resolve(self, text: str) -> str:
        """`text` with the absolute paths, tokens and `<lookups>` replaced by what stands for them here."""
        text = ABSOLUTE.sub(self.absolute, text)
        text = TOKEN.sub(lambda m: self.bound[m.group(1)], text)
        return re.sub(r"\S*<[a-z][a-z-]*>\S*", lambda m: self.lookup(m.group(0)), text)

    def lookup(self, word: str) -> str:
        """The newest path of the working folder matching `word` (`<...>` a name; at the start, any folders)."""
        key, _, value = word.rpartition("=") if "=" in word.split("<")[0] else ("", "", word)
        kinds = LOOKUP.findall(value)
        pattern = LOOKUP.sub("*", value).rstrip("/")
        matches = list(self.cwd.glob(pattern)) if not value.startswith("<") else \
            list(self.cwd.rglob(pattern.removeprefix("*/")))
        wanted = [k.removesuffix("-run") for k in kinds if k.endswith("-run")]
        if wanted:
            matches = [m for m in matches if wanted[0] in run_model(m)]
        if not matches:
            raise AssertionError(f"{self.guide}: nothing in the working folder matches {value!r}")
        newest = max(matches, key=lambda p: p.stat().st_mtime)
        found = str(newest.relative_to(self.cwd)) + ("/" if value.endswith("/") else "")
        return f"{key}={found}" if key else found

    def command_line(self, command: Command, script_overrides: tuple[str, list[str]] | None) -> str:
        """What runs: the command as typed, resolved, with the toy-size keys appended."""
        text = self.resolve(command.text)
        if script_overrides is None:
            return text
        script, _ = script_overrides
        resolved = Command(text, command.line).entry_point()
        assert resolved is not None
        if script != "train.py":
            return text
        toy = toy_overrides([w for w in resolved[1] if not w.startswith("-")])
        if not toy:
            return text
        quoted = " ".join(shell_quote(o) for o in toy)
        if text.startswith("make "):
            return f"{text} ARGS={shell_quote(' '.join(toy))}"
        return f"{text} {quoted}"

    def run(self, command: Command) -> subprocess.CompletedProcess:
        self.prepare(command.text)
        line = self.command_line(command, command.entry_point())
        return subprocess.run(["bash", "-c", line], cwd=self.cwd, env=self.env(), capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT)


def shell_quote(text: str) -> str:
    import shlex

    return shlex.quote(text)


def run_model(path: Path) -> str:
    """The model class of the run (or cascade stage) a found path lies in, from its saved config."""
    for folder in [path, *path.parents]:
        for config in (folder / "config.yaml", folder / ".hydra" / "config.yaml"):
            if config.is_file():
                return str(OmegaConf.load(config).get("model", {}).get("_target_", "")).lower()
    return ""


def trained_run(command: str, cache: Path) -> Path:
    """The run folder of a documented training command run once per session at toy size (in its own folder)."""
    folder = cache / "runs" / re.sub(r"\W+", "_", command)[:120]
    done = folder / ".done"
    if not done.exists():
        if folder.exists():
            shutil.rmtree(folder)
        sandbox = Sandbox("runs", folder, cache)
        sandbox.world = {}
        done_run = sandbox.run(Command(command, 0))
        assert done_run.returncode == 0, f"{command}\n{done_run.stdout[-3000:]}\n{done_run.stderr[-3000:]}"
        done.touch()
    runs = sorted(folder.glob("outputs/*/runs/*"), key=lambda p: p.stat().st_mtime)
    assert runs, f"{command} made no run under outputs/"
    return runs[-1]
