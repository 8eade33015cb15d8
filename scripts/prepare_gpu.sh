#!/usr/bin/env bash
# Run from the project root on your own machine before a lent GPU machine's first call:
#   bash scripts/prepare_gpu.sh [--trl]
# Builds .gpu/ with ../shared/gpu/prepare.sh (the wheels the GPU machine lacks, setup.sh, make_llama1b.py), then
# keeps only the CUDA 13 and CPU libraries of the bitsandbytes wheel (the machine runs torch 2.11 with CUDA 13): 43 ->
# 7 MiB, so that .gpu with TRL (60 MiB as built) and this checkout fit in the 64 MiB a run carries.
set -euo pipefail
bash ../shared/gpu/prepare.sh "$@"
python3 - <<'PY'
import glob
import os
import zipfile

KEEP = {"libbitsandbytes_cuda130.so", "libbitsandbytes_cuda132.so", "libbitsandbytes_cpu.so"}


def keep(name: str) -> bool:
    base = os.path.basename(name)
    return not (base.startswith("libbitsandbytes_") and base.endswith(".so")) or base in KEEP


for wheel in glob.glob(".gpu/whl/bitsandbytes-*.whl"):
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(wheel + ".new", "w", zipfile.ZIP_DEFLATED) as out:
        for info in source.infolist():
            if not keep(info.filename):
                continue
            data = source.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):  # pip checks the files it lists
                data = "".join(line + "\n" for line in data.decode().splitlines() if keep(line.split(",")[0])).encode()
            out.writestr(info, data)
    os.replace(wheel + ".new", wheel)
PY
cp scripts/gpu_session.sh .gpu/session.sh
size=$(du -sm .gpu | cut -f1)
echo ".gpu: ${size} MiB, with the checkout's tracked files: $(( size + $(git ls-files -z | du -cm --files0-from=- | tail -1 | cut -f1) )) MiB (at most 64)"
