"""The preflight's added time per family on this CPU: `preflight.predict` of each family's command, timed.

    OMP_NUM_THREADS=1 python benchmarks/gpu/preflight_time.py                 # the seed's sizes
    OMP_NUM_THREADS=1 python benchmarks/gpu/preflight_time.py --small         # toy sizes (seconds)

Each row composes the command's config and times one prediction (the module built from the config, made fake, two
training steps on fake tensors, the second's FLOPs counted): what a GPU run pays before its data is read, or, for a
plan made from the data, once planned. The config a row predicts is the one the run trains: a planned segmentation
run's plan (here the one the config gives whole: BraTS is 1 mm), a cascade's stage as the cascade runner merges it,
with the earlier stages' best checkpoints it is handed (random weights, written to a temporary folder before the
clock starts, as the runner has them on disk by then).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for a direct run
from benchmarks.common import composed, table_header  # noqa: E402

# A row: the command's overrides, and what makes the run's config of the composed one (None: the command's own).
Row = tuple[list[str], Callable[[Any, Path], Any] | None]


def planned(cfg: Any, folder: Path) -> Any:
    """The network the planned run trains: the plan the config gives whole (`plan_before_data`)."""
    from medvol.run.planning import plan_before_data

    return plan_before_data(cfg, "gpu")


def stage_config(cfg: Any, stage: int, earlier: list[str]) -> Any:
    """Cascade stage `stage` of `cfg` as the cascade runner merges it, handed the earlier stages' checkpoints."""
    from omegaconf import OmegaConf, open_dict

    from medvol.run.cascade import handoff_keys, with_stage_settings

    merged = with_stage_settings(cfg, cfg.cascade[f"stage{stage}"])
    keys = handoff_keys(cfg)
    with open_dict(merged):
        del merged["cascade"]
        if keys["stage"]:
            OmegaConf.update(merged, keys["stage"], stage, force_add=True)
        if keys["previous_stages"]:
            OmegaConf.update(merged, keys["previous_stages"], list(earlier), force_add=True)
        if keys["previous_best"] and earlier:
            OmegaConf.update(merged, keys["previous_best"], earlier[-1], force_add=True)
    return merged


def written_stages(cfg: Any, stages: int, folder: Path) -> list[str]:
    """Checkpoints of stages 1..`stages` with random weights, each built as its stage (after its earlier ones)."""
    import torch

    from lightning_modules.base import MODEL_KEY
    from medvol.core.build import build_model
    from medvol.core.plain_values import plain

    earlier: list[str] = []
    for stage in range(1, stages + 1):
        stage_cfg = stage_config(cfg, stage, earlier)
        module = build_model(stage_cfg.model)
        path = folder / f"stage{stage}.ckpt"
        torch.save({MODEL_KEY: str(stage_cfg.model._target_), "hyper_parameters": plain(dict(module.hparams)),
                    "state_dict": module.state_dict(), "loops": {}}, path)
        earlier.append(str(path))
    return earlier


def stage(number: int) -> Callable[[Any, Path], Any]:
    def prepare(cfg: Any, folder: Path) -> Any:
        return stage_config(cfg, number, written_stages(cfg, number - 1, folder))

    return prepare


SEED: dict[str, Row] = {
    "Fast-DDPM": (["experiment=fast_ddpm_brats", "dataset.root=/unused"], None),
    "VQ-GAN": (["experiment=ctpa_vqgan", "dataset.root=/unused", "hardware=cpu"], None),
    "segmentation, the config's network": (
        ["experiment=brats_segmentation", "dataset.root=/unused", "dataset.batch_size=2",
         "model.patch_size=[128,128,128]", "model.plan.use=false"], None),
    "segmentation, planned (DynUNet 32-320)": (
        ["experiment=brats_segmentation", "dataset.root=/unused", "model.plan.spacing=[1,1,1]",
         "model.plan.batch_size=2"], planned),
    "LDM, stage 2": (["experiment=ctpa_ldm", "dataset.root=/unused"], stage(2)),
    **{f"X-ray-to-CT, stage {k}": (["experiment=xray2ct_a100x4", "dataset.root=/unused"], stage(k)) for k in (1, 2, 3)},
}
SMALL: dict[str, Row] = {
    "Fast-DDPM": (["model=ddpm", "dataset.size=24"], None),
    "VQ-GAN": (["model=vqgan", "dataset.size=32", "dataset.batch_size=1"], None),
    "segmentation": (["model=segmentation", "dataset.size=16", "model.patch_size=[16,16,16]",
                      "model.num_classes=3"], None),
    "segmentation, planned": (
        ["model=segmentation", "dataset.size=16", "model.num_classes=3", "model.plan.use=true",
         "model.plan.spacing=[1,1,2]", "model.plan.patch_size=[32,32,16]", "model.plan.batch_size=2",
         "model.plan.features=[8,16,32,64]"], planned),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="toy sizes instead of the seed's")
    parser.add_argument("--only", nargs="*", default=None, help="rows whose name starts with one of these")
    args = parser.parse_args()
    from medvol.run.preflight import predict

    print(table_header(["family", "command", "predicted peak (GiB)", "TFLOP a step", "preflight time (s)"]))
    for family, (overrides, prepare) in (SMALL if args.small else SEED).items():
        if args.only and not family.startswith(tuple(args.only)):
            continue
        cfg = composed([*overrides, "paths.output_dir=/tmp/preflight_time"], job_name="preflight_time")
        with tempfile.TemporaryDirectory() as folder:
            run_cfg = prepare(cfg, Path(folder)) if prepare else cfg
            began = time.perf_counter()
            prediction = predict(run_cfg, "bf16-mixed")
            seconds = time.perf_counter() - began
        print(f"| {family} | `{' '.join(overrides)}` | {prediction.peak / 2**30:.2f} | "
              f"{prediction.flops / 1e12:.2f} | {seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
