#!/usr/bin/env bash
# Download the cp312 wheels the H200 machine lacks (it has torch 2.11, triton, numpy, rich,
# tensorboard, PyYAML, matplotlib, pytest, but no internet) into .whl/ (git-ignored).
#   learner only  : bash experiments/fetch_device_wheels.sh
#   real training : bash experiments/fetch_device_wheels.sh --training
# Then pass carry=[".whl"] to the device run; experiments/gpu_run.sh installs them.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
get() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$@"
}
get unilab==1.5.2 omegaconf==2.4.0
if [[ "${1:-}" == "--training" ]]; then
  # UniLab's minimal training set (../shared/reference/unilab.md), minus what the image has.
  get unisim-core==2.2.0 mujoco==3.11.0 mjbatch-uni==0.2.5 hydra-core==1.3.8 gymnasium==1.4.0 \
      farama-notifications cloudpickle glfw prettytable wcwidth
  # hydra-core needs antlr4 4.9.3, which has no wheel on PyPI: build one here.
  python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
  rm -f .whl/omegaconf-2.4.0-*.whl && get omegaconf==2.3.1
fi
ls -la .whl
