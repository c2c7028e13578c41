#!/usr/bin/env bash
# The images `make classroom-test` runs (`make classroom-images` calls this; docker/README.md,
# "The class's images in one command"), from the repository root, one after the other:
#
#   learner     docker/lab-cpu.Dockerfile                     -> $MINIVLLM_LEARNER_IMAGE (minivllm/lab-cpu)
#   instructor  docker/lab-cpu.Dockerfile --target instructor -> $MINIVLLM_INSTRUCTOR_IMAGE (minivllm/lab-cpu-instructor)
#   grader      docker/grader.Dockerfile                      -> $MINIVLLM_GRADER_IMAGE (minivllm/grader)
#
#   scripts/build_classroom_images.sh                       # all three
#   scripts/build_classroom_images.sh learner               # some of them
#   BASE_IMAGE=my/python:3.11 TORCH_WHEEL=/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl \
#       scripts/build_classroom_images.sh
#
# BASE_IMAGE: the base every image is built on. Unset: python:3.11-slim-bookworm if docker
# has it; else the offline stand-in minivllm/base:py311-bookworm if docker has it; else
# python:3.11-slim-bookworm if docker can pull it (60 s at most); else the stand-in, built
# first with scripts/build_base_image.sh (needs root, debootstrap and a Debian mirror;
# BASE_MIRROR passes its --mirror).
# TORCH_WHEEL: a torch wheel file to install instead of PyTorch's index (where the index is
# out of reach): served for the build from its folder by a local HTTP server on
# 127.0.0.1:$WHEEL_PORT (8765), the builds on the host's network (--network host); the
# server stops when the script ends. The rest comes from the package index as usual.
# Docker's layer cache makes a build of unchanged sources take seconds; an edit to what the
# install copies (pyproject.toml, README.md, scripts/install.sh, minivllm/, minivllm_kernels/,
# grading/) reinstalls and converts the model again: 3-6 minutes an image on 2 shared cores.
set -euo pipefail

cd "$(dirname "$0")/.."
LEARNER=${MINIVLLM_LEARNER_IMAGE:-minivllm/lab-cpu}
INSTRUCTOR=${MINIVLLM_INSTRUCTOR_IMAGE:-minivllm/lab-cpu-instructor}
GRADER=${MINIVLLM_GRADER_IMAGE:-minivllm/grader}
PUBLIC_BASE=python:3.11-slim-bookworm
OFFLINE_BASE=minivllm/base:py311-bookworm
WHEEL_PORT=${WHEEL_PORT:-8765}

say() { echo "[classroom-images] $*" >&2; }

targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(learner instructor grader)
for t in "${targets[@]}"; do
    case $t in learner|instructor|grader) ;; *) say "unknown image '$t' (learner, instructor, grader)"; exit 2 ;; esac
done
if ! docker info >/dev/null 2>&1; then
    say "docker info failed: no Docker engine to build with"
    exit 1
fi

has() { docker image inspect "$1" >/dev/null 2>&1; }

base=${BASE_IMAGE:-}
if [ -z "$base" ]; then
    if has "$PUBLIC_BASE"; then
        base=$PUBLIC_BASE
    elif has "$OFFLINE_BASE"; then
        say "$PUBLIC_BASE not here; the offline stand-in $OFFLINE_BASE is (BASE_IMAGE picks another)"
        base=$OFFLINE_BASE
    elif timeout 60 docker pull "$PUBLIC_BASE" >/dev/null 2>&1; then
        base=$PUBLIC_BASE
    else
        say "$PUBLIC_BASE: the registry is out of reach; building the offline stand-in $OFFLINE_BASE" \
            "(scripts/build_base_image.sh: root, debootstrap, a Debian mirror)"
        scripts/build_base_image.sh --tag "$OFFLINE_BASE" ${BASE_MIRROR:+--mirror "$BASE_MIRROR"}
        base=$OFFLINE_BASE
    fi
fi
args=(--build-arg "BASE_IMAGE=$base")

if [ -n "${TORCH_WHEEL:-}" ]; then
    [ -f "$TORCH_WHEEL" ] || { say "TORCH_WHEEL=$TORCH_WHEEL is not a file"; exit 2; }
    python3 -m http.server "$WHEEL_PORT" --bind 127.0.0.1 \
        --directory "$(dirname "$(realpath "$TORCH_WHEEL")")" >/dev/null 2>&1 &
    server=$!
    trap 'kill "$server" 2>/dev/null || true' EXIT
    name=$(basename "$TORCH_WHEEL")
    url="http://127.0.0.1:$WHEEL_PORT/${name//+/%2B}"
    for _ in $(seq 50); do  # until the server answers
        python3 -c "import urllib.request as u; u.urlopen(u.Request('$url', method='HEAD'))" \
            2>/dev/null && break
        sleep 0.1
    done
    args+=(--network host --build-arg "TORCH_SPEC=torch @ $url" --build-arg TORCH_INDEX_URL=)
fi

say "base $base${TORCH_WHEEL:+, torch from $TORCH_WHEEL}"
for t in "${targets[@]}"; do
    case $t in
        learner) cmd=(-f docker/lab-cpu.Dockerfile -t "$LEARNER") ;;
        instructor) cmd=(-f docker/lab-cpu.Dockerfile --target instructor -t "$INSTRUCTOR") ;;
        grader) cmd=(-f docker/grader.Dockerfile -t "$GRADER") ;;
    esac
    start=$(date +%s)
    say "docker build ${cmd[*]} ."
    docker build "${args[@]}" "${cmd[@]}" .
    say "$t: ${cmd[-1]} in $(( $(date +%s) - start )) s"
done
