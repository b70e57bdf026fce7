#!/usr/bin/env bash
# The wheels the GPU machine lacks, for benchmarks/gpu_round.py (docs/gpu_round.md).
#
#   bash benchmarks/gpu_round_wheels.sh          # here, with PyPI reachable: fills .whl/ (ignored by git)
#
# The device image has Python 3.12 with torch, Lightning, torchmetrics, numpy, scipy, scikit-image, einops,
# tensorboard, rich, pillow, pyyaml, pandas, scikit-learn and pytest (+ xdist, timeout), but not these. The
# versions are those a fresh `pip install -e '.[dev]'` gives on Python 3.12 (checked 2026-11-27 with pip's
# `--dry-run --report --python-version 3.12`; omegaconf 2.4 and pandas 3 exist, hydra-core 1.3.8 and lifelines
# 0.30.3 keep them below). Of the image's own packages that user gets numpy 2.5.5, scipy 1.18.1 (whose sqrtm
# refuses the `disp` MONAI 1.6's FIDMetric passed: medvol's FID no longer calls it), scikit-learn 1.9.1, pandas
# 2.3.3 and scikit-image 0.26.0: too large to carry (about 80 MB), so the end of this script prints what pip
# would give today, to hold against the round's environment step. scikit-survival 0.28.0 is not carried either
# (it needs scikit-learn 1.9 exactly): the tests that compare with it skip. Every wheel is for CPython 3.12 on x86-64 Linux; the
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
  # nnU-Net's own training step beside medvol's (benchmarks/segmentation/nnunet_plans.py gpu-step): its network, loss and what
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
# What a Python 3.12 user's install gives of the packages the image brings itself (the round's environment step
# records the image's): a resolution without download.
report=$(mktemp)
scratch=$(mktemp -d)  # pip takes platform options for a --target alone; --dry-run installs nothing there
# The venv's pip (make setup upgrades it): pip 23.2 held these against the running interpreter's Python instead of
# 3.12 (it chose scipy 1.17.1, which a 3.12 user does not get).
pip=(python3 -m pip)
if [ -x .venv/bin/python ]; then pip=(.venv/bin/python -m pip); fi
"${pip[@]}" install -q --dry-run --ignore-installed --report "$report" --target "$scratch" --python-version 3.12 \
  --implementation cp --only-binary=:all: "${PLATFORMS[@]}" numpy scipy scikit-learn scikit-image pandas pillow \
  lifelines scikit-survival
python3 - "$report" <<'PY'
import json, sys
chosen = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.load(open(sys.argv[1]))["install"]}
names = ("numpy", "scipy", "scikit-learn", "scikit-image", "pandas", "pillow", "lifelines", "scikit-survival")
print("a Python 3.12 install gives: " + ", ".join(f"{n} {chosen.get(n, '?')}" for n in names))
PY
rm -rf "$report" "$scratch"
# The working tree and the carried folders travel together, 64 MiB at most.
total=$(du -cb .whl/*.whl | tail -1 | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
echo "wheels: $((total / 1024)) KiB; with the tracked tree: $(((total + tree) / 1024 / 1024)) MiB of the 64 MiB a call carries"
if [ $((total + tree)) -gt $((60 * 1024 * 1024)) ]; then
  echo "too large to carry: keep the wheels and the tree under 60 MiB" >&2
  exit 1
fi
