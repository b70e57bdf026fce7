"""CPU time of the CTPA VQ-GAN's training step, from the checkout this script is given.

    .venv/bin/python benchmarks/gpu/vqgan_step_time.py [--root DIR] [--size 48] [--steps 3] [--warmup 1] [overrides ...]

Times `benchmarks.training.overhead.gan_step` (the training step without Lightning, discriminators on)
of the checkout at `--root` (default: this one) on the `experiment=ctpa_vqgan` model, one thread,
one random patch; prints the median process CPU time per step as JSON. To compare the step of
an older commit with this one, export it (`git archive <commit> | tar -x -C /tmp/old`) and run
the script alternately with `--root /tmp/old` and without, so that the machine's load hits both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[2]), help="checkout whose code is timed")
    parser.add_argument("--size", type=int, default=48, help="patch edge in voxels")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="steps left out (codebook initialisation)")
    args, overrides = parser.parse_known_args()
    root = Path(args.root).resolve()
    sys.path.insert(0, str(root))

    import torch
    from hydra import compose, initialize_config_dir

    import medvol.run.resolvers  # noqa: F401 - resolvers used by the configs
    from medvol.core.build import build_model

    try:
        from benchmarks.training.overhead import gan_step
    except ModuleNotFoundError:  # a checkout from before benchmarks/ was grouped by what it measures
        from benchmarks.overhead import gan_step

    torch.set_num_threads(1)
    with initialize_config_dir(version_base="1.3", config_dir=str(root / "conf"), job_name="vqgan_step_time"):
        cfg = compose(config_name="train", overrides=["experiment=ctpa_vqgan", "model.in_channels=1", *overrides])
    torch.manual_seed(0)
    model = build_model(cfg.model).train()
    opt_ae, opt_disc = model.configure_optimizers()
    x = torch.rand(1, 1, args.size, args.size, args.size) * 2 - 1
    durations = []
    for _ in range(args.warmup + args.steps):
        start = time.process_time()
        gan_step(model, opt_ae, opt_disc, x)
        durations.append(time.process_time() - start)
    step = statistics.median(durations[args.warmup :])
    print(json.dumps({"root": str(root), "size": args.size, "cpu_ms_per_step": round(1000 * step, 1)}))


if __name__ == "__main__":
    main()
