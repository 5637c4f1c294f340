#!/usr/bin/env bash
# Download, on this machine (it reaches PyPI), the wheels the lent GPU's image lacks, into .whl/
# at the repository root (ignored by git); `run` then carries them: carry: [".whl"].
# The image has Python 3.12 and torch, transformers, peft, safetensors, tensorboard, pyarrow,
# fsspec, tqdm, pillow, numpy, pyyaml; it lacks diffusers, pydantic and what they need.
#   bash benchmarks/gpu/fetch_wheels.sh [--bnb]     # --bnb: also bitsandbytes (43 MB)
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
wheels=(
    diffusers==0.42.1 importlib_metadata==10.2.0
    pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.8.0 typing-inspection==0.4.5
    typing_extensions==4.16.0 braceexpand==0.1.7
)
if [[ "${1:-}" == "--bnb" ]]; then
    wheels+=(bitsandbytes==0.50.2)
fi
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${wheels[@]}"
du -sh .whl
