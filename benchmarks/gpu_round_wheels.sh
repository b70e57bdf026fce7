#!/usr/bin/env bash
# The wheels the GPU machine lacks, for benchmarks/gpu_round.py (docs/BENCHMARKS.md, "The GPU round").
#
#   bash benchmarks/gpu_round_wheels.sh          # here, with PyPI reachable: fills .whl/ (ignored by git)
#
# The device image has Python 3.12 with torch, Lightning, torchmetrics, numpy, scipy, scikit-image, einops,
# tensorboard, rich, pillow, pyyaml, pandas, scikit-learn and pytest (+ xdist, timeout), but not these. The
# versions are those of the project's tested environment. Every wheel is for CPython 3.12 on x86-64 Linux; the
# two published as source archives alone, antlr4-python3-runtime 4.9.3 (what omegaconf 2.3 pins) and
# autograd-gamma 0.5.0 (lifelines'), are built into pure-Python wheels here. The round's command installs them with
# `pip install --no-index --no-deps --target /tmp/site .whl/*.whl` and puts /tmp/site on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."

# name==version, one per line: medvol's dependencies and what they need, and the test-only lifelines.
WHEELS=(
  hydra-core==1.3.8
  omegaconf==2.3.1
  monai==1.6.1
  nibabel==5.4.2
  torchsurv==0.2.0
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
  pydicom==3.0.2
  pylibjpeg==2.1.0
  pylibjpeg-libjpeg==2.5.0
  pylibjpeg-openjpeg==2.6.0
  highdicom==0.28.2
  pyjpegls==1.5.1
  lifelines==0.30.3
  autograd==1.9.1
  # nnU-Net's own training step beside medvol's (benchmarks/nnunet_plans.py gpu-step): its network, loss and what
  # they import (batchgenerators' file utilities).
  nnunetv2==2.8.1
  dynamic-network-architectures==0.4.4
  batchgenerators==0.25.5
)
SOURCE_ONLY=(antlr4-python3-runtime==4.9.3 autograd-gamma==0.5.0)
PLATFORMS=()
for tag in manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$tag")
done

rm -rf .whl
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d .whl "${WHEELS[@]}"
python3 -m pip wheel -q --no-deps -w .whl "${SOURCE_ONLY[@]}"
ls -1 .whl
# The working tree and the carried folders travel together, 64 MiB at most.
total=$(du -cb .whl/*.whl | tail -1 | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
echo "wheels: $((total / 1024)) KiB; with the tracked tree: $(((total + tree) / 1024 / 1024)) MiB of the 64 MiB a call carries"
if [ $((total + tree)) -gt $((60 * 1024 * 1024)) ]; then
  echo "too large to carry: keep the wheels and the tree under 60 MiB" >&2
  exit 1
fi
