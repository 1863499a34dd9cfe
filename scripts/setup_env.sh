#!/usr/bin/env bash
# Creates the virtual environment when missing and installs the project into it.
#   scripts/setup_env.sh VENV [EXTRAS]      e.g. scripts/setup_env.sh .venv dev
# Then swaps pillow for pillow-simd (much faster resizes) when it builds, else keeps pillow.
set -euo pipefail
VENV=${1:-.venv}
EXTRAS=${2:-}
PYTHON=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
TARGET="."
[ -n "$EXTRAS" ] && TARGET=".[$EXTRAS]"
echo "setup: installing mimo-epd $TARGET (torch comes from the local wheel cache when it has it)"
$PIP install -q -e "$TARGET"

# --- pillow-simd --------------------------------------------------------------------------------
# Built once into $VENV/.wheels. `pip install -e .` re-installs plain pillow (a declared dependency)
# over it, so the swap runs after every install: remove both, install the simd wheel.
WHEELS="$VENV/.wheels"
mkdir -p "$WHEELS"
if ! ls "$WHEELS"/pillow_simd-*.whl >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && ! dpkg -s libjpeg-dev zlib1g-dev >/dev/null 2>&1; then
    echo "setup: installing libjpeg-dev zlib1g-dev for pillow-simd"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libjpeg-dev zlib1g-dev) >/dev/null 2>&1 || true
  fi
  echo "setup: building pillow-simd (about 20 s)"
  $PIP wheel -q --no-deps -w "$WHEELS" pillow-simd >"$WHEELS/build.log" 2>&1 || true
fi
if ls "$WHEELS"/pillow_simd-*.whl >/dev/null 2>&1; then
  $PIP uninstall -q -y pillow pillow-simd >/dev/null 2>&1 || true
  $PIP install -q --no-deps "$WHEELS"/pillow_simd-*.whl
  echo "setup: using pillow-simd"
else
  echo "notice: pillow-simd did not build (see $WHEELS/build.log); using pillow, resizes on the CPU are slower"
fi
# --- NVIDIA DALI (optional `dali` extra) for the dev/test environment: best effort -------------------
if [[ "$EXTRAS" == *dev* ]] && ! "$VENV/bin/python" -c "import nvidia.dali" >/dev/null 2>&1; then
  if $PIP install -q "nvidia-dali-cuda130" >"$WHEELS/dali.log" 2>&1; then
    echo "setup: installed NVIDIA DALI (decoder backend --decoder dali)"
  else
    echo "notice: NVIDIA DALI did not install (see $WHEELS/dali.log); its tests are skipped"
  fi
fi
"$VENV/bin/mimo-epd" version
