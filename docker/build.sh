#!/usr/bin/env bash
# Build the finetune images: base (CUDA + pinned GPU stack) -> main (finetune) -> cloud (pods).
#
# Every library version comes from finetune/versions.py and the finetune version from
# finetune/__init__.py, both read with python here, so the images cannot drift from the pins the
# code enforces at run time. Tags:
#
#   finetune:<version>-cu<cuda>-torch<torch>-base    e.g. finetune:0.1.0-cu130-torch2.13.0-base
#   finetune:<version>-cu<cuda>-torch<torch>         the main image
#   finetune:<version>-cu<cuda>-torch<torch>-cloud[-ssh][-jupyter]
#
# See docker/README.md. Needs docker with BuildKit (the per-Dockerfile .dockerignore files keep
# .venv and local files out of the build context).
set -euo pipefail

usage() {
    cat << 'EOF'
Usage: docker/build.sh [options] [-- extra docker build args]

  --push REGISTRY      also tag as REGISTRY/finetune:<tag> and push (e.g. ghcr.io/acme)
  --only LIST          comma-separated subset of base,main,cloud (default: all three)
  --cuda VERSION       CUDA toolkit of the nvidia/cuda base image (default: 13.0.1)
  --ubuntu VERSION     Ubuntu release of the base image (default: 24.04)
  --python VERSION     Python in the image (default: 3.12)
  --arch-list LIST     TORCH_CUDA_ARCH_LIST (default: "8.0;8.6;8.9;9.0")
  --flash-archs LIST   FLASH_ATTN_CUDA_ARCHS, flash-attn's own arch families (default: "80;90")
  --max-jobs N         parallel nvcc jobs for flash-attn, ~4-9 GB RAM each (default: 4)
  --uid N / --gid N    ids of the image's unprivileged user (default: 1000 / 1000)
  --with-ssh           cloud image with sshd
  --with-jupyter       cloud image with JupyterLab
  --name NAME          image repository name (default: finetune)
  --dry-run            print the docker commands instead of running them
  -h, --help           this help

Environment: PYTHON (interpreter used to read the pins, default python3).
EOF
}

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"

CUDA_VERSION="13.0.1"
UBUNTU_VERSION="24.04"
PYTHON_VERSION="3.12"
TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0"
FLASH_ATTN_CUDA_ARCHS="80;90"
MAX_JOBS="4"
FINETUNE_UID="1000"
FINETUNE_GID="1000"
WITH_SSH=0
WITH_JUPYTER=0
NAME="finetune"
REGISTRY=""
ONLY="base,main,cloud"
DRY_RUN=0
EXTRA_ARGS=()

need_value() {
    if [[ $# -lt 2 || -z "$2" ]]; then
        echo "build.sh: $1 needs a value" >&2
        exit 2
    fi
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --push) need_value "$@"; REGISTRY="${2%/}"; shift 2 ;;
        --only) need_value "$@"; ONLY="$2"; shift 2 ;;
        --cuda) need_value "$@"; CUDA_VERSION="$2"; shift 2 ;;
        --ubuntu) need_value "$@"; UBUNTU_VERSION="$2"; shift 2 ;;
        --python) need_value "$@"; PYTHON_VERSION="$2"; shift 2 ;;
        --arch-list) need_value "$@"; TORCH_CUDA_ARCH_LIST="$2"; shift 2 ;;
        --flash-archs) need_value "$@"; FLASH_ATTN_CUDA_ARCHS="$2"; shift 2 ;;
        --max-jobs) need_value "$@"; MAX_JOBS="$2"; shift 2 ;;
        --uid) need_value "$@"; FINETUNE_UID="$2"; shift 2 ;;
        --gid) need_value "$@"; FINETUNE_GID="$2"; shift 2 ;;
        --with-ssh) WITH_SSH=1; shift ;;
        --with-jupyter) WITH_JUPYTER=1; shift ;;
        --name) need_value "$@"; NAME="$2"; shift 2 ;;
        --dry-run) DRY_RUN=1; shift ;;
        -h | --help) usage; exit 0 ;;
        --) shift; EXTRA_ARGS=("$@"); break ;;
        *) echo "build.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
done

for target in ${ONLY//,/ }; do
    case "${target}" in
        base | main | cloud) ;;
        *) echo "build.sh: --only takes base, main and/or cloud, got ${target}" >&2; exit 2 ;;
    esac
done

# --- versions, from the code -------------------------------------------------------------------
# `python -m finetune.versions` prints KEY=VALUE lines. They are assigned one by one (no eval), and
# only the keys we expect, so the output cannot run anything.
TORCH_VERSION="" TRANSFORMERS_VERSION="" PEFT_VERSION=""
LIGER_KERNEL_VERSION="" BITSANDBYTES_VERSION="" FLASH_ATTN_VERSION=""
pins="$(cd "${ROOT}" && "${PYTHON}" -m finetune.versions)"
while IFS='=' read -r key value; do
    case "${key}" in
        TORCH_VERSION | TRANSFORMERS_VERSION | PEFT_VERSION | LIGER_KERNEL_VERSION | BITSANDBYTES_VERSION | FLASH_ATTN_VERSION)
            printf -v "${key}" '%s' "${value}" ;;
        *) echo "build.sh: unexpected line from finetune.versions: ${key}" >&2; exit 1 ;;
    esac
done <<< "${pins}"
for key in TORCH_VERSION TRANSFORMERS_VERSION PEFT_VERSION LIGER_KERNEL_VERSION BITSANDBYTES_VERSION FLASH_ATTN_VERSION; do
    if [[ -z "${!key}" ]]; then
        echo "build.sh: finetune.versions did not provide ${key}" >&2
        exit 1
    fi
done

# The package version, read from the file without importing anything.
VERSION="$("${PYTHON}" - "${ROOT}/finetune/__init__.py" << 'EOF'
import re, sys
text = open(sys.argv[1], encoding="utf-8").read()
print(re.search(r"^__version__\s*=\s*[\"']([^\"']+)[\"']", text, re.M).group(1))
EOF
)"

# cu<major><minor>: the PyTorch wheel index and local version label for this CUDA (13.0.1 -> cu130).
if [[ ! "${CUDA_VERSION}" =~ ^([0-9]+)\.([0-9]+)(\.[0-9]+)?$ ]]; then
    echo "build.sh: --cuda wants a version like 13.0.1, got ${CUDA_VERSION}" >&2
    exit 2
fi
TORCH_CUDA="cu${BASH_REMATCH[1]}${BASH_REMATCH[2]}"

TAG="${VERSION}-${TORCH_CUDA}-torch${TORCH_VERSION}"
PREFIX=""
[[ -n "${REGISTRY}" ]] && PREFIX="${REGISTRY}/"
BASE_REF="${PREFIX}${NAME}:${TAG}-base"
MAIN_REF="${PREFIX}${NAME}:${TAG}"
CLOUD_SUFFIX="-cloud"
[[ "${WITH_SSH}" == 1 ]] && CLOUD_SUFFIX+="-ssh"
[[ "${WITH_JUPYTER}" == 1 ]] && CLOUD_SUFFIX+="-jupyter"
CLOUD_REF="${PREFIX}${NAME}:${TAG}${CLOUD_SUFFIX}"

REVISION="$(git -C "${ROOT}" rev-parse HEAD 2> /dev/null || echo unknown)"
LABELS=(
    --label "org.opencontainers.image.version=${VERSION}"
    --label "org.opencontainers.image.revision=${REVISION}"
)

run() {
    printf '+'
    printf ' %q' "$@"
    printf '\n'
    if [[ "${DRY_RUN}" == 0 ]]; then
        "$@"
    fi
}

wants() { [[ ",${ONLY}," == *",$1,"* ]]; }

export DOCKER_BUILDKIT=1
BUILT=()

if wants base; then
    run docker build -f "${ROOT}/docker/Dockerfile.base" -t "${BASE_REF}" "${LABELS[@]}" \
        --build-arg "CUDA_VERSION=${CUDA_VERSION}" \
        --build-arg "UBUNTU_VERSION=${UBUNTU_VERSION}" \
        --build-arg "PYTHON_VERSION=${PYTHON_VERSION}" \
        --build-arg "TORCH_VERSION=${TORCH_VERSION}" \
        --build-arg "TORCH_CUDA=${TORCH_CUDA}" \
        --build-arg "TRANSFORMERS_VERSION=${TRANSFORMERS_VERSION}" \
        --build-arg "PEFT_VERSION=${PEFT_VERSION}" \
        --build-arg "LIGER_KERNEL_VERSION=${LIGER_KERNEL_VERSION}" \
        --build-arg "BITSANDBYTES_VERSION=${BITSANDBYTES_VERSION}" \
        --build-arg "FLASH_ATTN_VERSION=${FLASH_ATTN_VERSION}" \
        --build-arg "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST}" \
        --build-arg "FLASH_ATTN_CUDA_ARCHS=${FLASH_ATTN_CUDA_ARCHS}" \
        --build-arg "MAX_JOBS=${MAX_JOBS}" \
        ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"} "${ROOT}"
    BUILT+=("${BASE_REF}")
fi

if wants main; then
    run docker build -f "${ROOT}/docker/Dockerfile" -t "${MAIN_REF}" "${LABELS[@]}" \
        --build-arg "BASE_IMAGE=${BASE_REF}" \
        --build-arg "TRANSFORMERS_VERSION=${TRANSFORMERS_VERSION}" \
        --build-arg "PEFT_VERSION=${PEFT_VERSION}" \
        --build-arg "FINETUNE_UID=${FINETUNE_UID}" \
        --build-arg "FINETUNE_GID=${FINETUNE_GID}" \
        ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"} "${ROOT}"
    BUILT+=("${MAIN_REF}")
fi

if wants cloud; then
    run docker build -f "${ROOT}/docker/Dockerfile.cloud" -t "${CLOUD_REF}" "${LABELS[@]}" \
        --build-arg "MAIN_IMAGE=${MAIN_REF}" \
        --build-arg "FINETUNE_UID=${FINETUNE_UID}" \
        --build-arg "FINETUNE_GID=${FINETUNE_GID}" \
        --build-arg "WITH_SSH=${WITH_SSH}" \
        --build-arg "WITH_JUPYTER=${WITH_JUPYTER}" \
        ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"} "${ROOT}"
    BUILT+=("${CLOUD_REF}")
fi

if [[ -n "${REGISTRY}" ]]; then
    for ref in "${BUILT[@]}"; do
        run docker push "${ref}"
    done
fi

printf 'built: %s\n' "${BUILT[@]}"
