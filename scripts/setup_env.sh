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
# Mooncake's transfer engine (prefill/decode KV transfer) loads libibverbs even for TCP: installed when missing.
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "setup: installing libibverbs1 (Mooncake transfer engine)"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1) >/dev/null 2>&1 || \
    echo "notice: libibverbs1 did not install; prefill/decode disaggregation cannot start its transfer engine"
fi
$PIP install -q -e "$TARGET"

# --- Mooncake's CUDA build where a GPU is present ---------------------------------------------------
# Both wheels are the `mooncake` package; the CPU one is the declared dependency, so `pip install -e .` puts it back
# and the swap runs after every install (as pillow-simd's below). The CUDA build registers GPU memory (the KV pools
# on the device) with the transfer engine and does GPUDirect RDMA; it needs the CUDA runtime, so it goes only where
# `nvidia-smi` lists a GPU. MOONCAKE_WHEEL=cpu keeps the CPU wheel anyway.
MOONCAKE_VERSION=$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('mooncake-transfer-engine-non-cuda'))" 2>/dev/null || true)
if [ "${MOONCAKE_WHEEL:-auto}" != cpu ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  echo "setup: a GPU is present: Mooncake's CUDA transfer engine ${MOONCAKE_VERSION} replaces the CPU wheel"
  $PIP uninstall -q -y mooncake-transfer-engine-non-cuda >/dev/null 2>&1 || true
  $PIP install -q --no-deps "mooncake-transfer-engine${MOONCAKE_VERSION:+==$MOONCAKE_VERSION}" || {
    echo "notice: the CUDA transfer engine did not install; back to the CPU wheel (KV pools on the GPU cannot be registered)"
    $PIP install -q --no-deps "mooncake-transfer-engine-non-cuda${MOONCAKE_VERSION:+==$MOONCAKE_VERSION}"
  }
fi

# --- pillow-simd --------------------------------------------------------------------------------
# Built once into $VENV/.wheels. `pip install -e .` re-installs plain pillow (a declared dependency)
# over it, so the swap runs after every install: remove both, install the simd wheel.
# Pillow builds a format only when its library's headers are present at build time: without libwebp-dev
# the wheel silently lacks WebP (a documented format), so the headers are installed first, and a cached
# wheel built without WebP is rebuilt (once).
WHEELS="$VENV/.wheels"
PILLOW_DEV_PKGS="libjpeg-dev zlib1g-dev libwebp-dev libtiff-dev libpng-dev"
mkdir -p "$WHEELS"
install_image_headers() {
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && ! dpkg -s $PILLOW_DEV_PKGS >/dev/null 2>&1; then
    echo "setup: installing $PILLOW_DEV_PKGS for pillow-simd"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $PILLOW_DEV_PKGS) >/dev/null 2>&1 || true
  fi
}
build_pillow_simd() {
  install_image_headers
  echo "setup: building pillow-simd (about 20 s)"
  $PIP wheel -q --no-deps --no-cache-dir -w "$WHEELS" pillow-simd >"$WHEELS/build.log" 2>&1 || true
}
install_pillow_simd() {
  $PIP uninstall -q -y pillow pillow-simd >/dev/null 2>&1 || true
  $PIP install -q --no-deps "$WHEELS"/pillow_simd-*.whl
}
pil_has_webp() { "$VENV/bin/python" -c "import sys, PIL.features as f; sys.exit(0 if f.check('webp') else 1)" 2>/dev/null; }
if ! ls "$WHEELS"/pillow_simd-*.whl >/dev/null 2>&1; then
  build_pillow_simd
fi
if ls "$WHEELS"/pillow_simd-*.whl >/dev/null 2>&1; then
  install_pillow_simd
  if ! pil_has_webp; then
    echo "setup: the cached pillow-simd wheel has no WebP support; rebuilding it"
    rm -f "$WHEELS"/pillow_simd-*.whl
    build_pillow_simd
    if ls "$WHEELS"/pillow_simd-*.whl >/dev/null 2>&1; then install_pillow_simd; fi
  fi
  if ls "$WHEELS"/pillow_simd-*.whl >/dev/null 2>&1 && pil_has_webp; then
    echo "setup: using pillow-simd"
  else
    echo "notice: pillow-simd has no WebP support (libwebp-dev missing when it was built?): WebP images will be refused"
  fi
else
  echo "notice: pillow-simd did not build (see $WHEELS/build.log); using pillow, resizes on the CPU are slower"
fi
# --- redis-server for the dev/test environment: the routers' shared-state tests start a real one -------
# (Debian package, installed when missing and run as root; the tests skip with a reason when it is absent.)
if [[ "$EXTRAS" == *dev* ]] && ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing redis-server (router shared-state tests)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null 2>&1 || true
  fi
  command -v redis-server >/dev/null 2>&1 || echo "notice: redis-server is not installed; the shared-state router tests are skipped"
fi
# --- Mooncake Store's other shared libraries (libibverbs1: above) ------------------------------------
MOONCAKE_PKGS="libnuma1 libcurl4"
if ! dpkg -s $MOONCAKE_PKGS >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing $MOONCAKE_PKGS (--kv-store mooncake://)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $MOONCAKE_PKGS) >/dev/null 2>&1 || true
  fi
  dpkg -s $MOONCAKE_PKGS >/dev/null 2>&1 || echo "notice: $MOONCAKE_PKGS missing; --kv-store mooncake:// will not load"
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
