#!/usr/bin/env bash
# Retrains the shipped default model (mimo_epd/data/models/tiny) from its corpus; docs/model.md has the recipe.
#   scripts/train_tiny.sh [OUT_DIR] [extra train-tiny flags]
# Installs the corpus, Debian's python3.11-doc (the Python 3.11 documentation, PSF licence), when missing
# (needs root and apt), then runs `mimo-epd train-tiny` with the shipped model's flags (the defaults).
# Resumable: run it again with the same OUT_DIR after an interruption.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-build/tiny}
shift || true
DOCS=/usr/share/doc/python3.11/html
if [ ! -d "$DOCS" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "train_tiny: installing python3.11-doc (the training corpus)" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3.11-doc >/dev/null
  else
    echo "train_tiny: $DOCS is missing; install the Debian package python3.11-doc" >&2
    exit 2
  fi
fi
# The shipped model is this run with the default flags (40 minutes on a busy two-core machine).
.venv/bin/mimo-epd train-tiny --out "$OUT" --corpus-root "$DOCS" "$@"
# STAGE2=1: a second stage from that checkpoint (more greetings and questions, other samples, a lower learning rate).
if [ "${STAGE2:-0}" = 1 ]; then
  .venv/bin/mimo-epd train-tiny --out "$OUT.stage2" --corpus-root "$DOCS" --init-from "$OUT" --seed 1 --steps 180 \
    --lr 1e-3 --warmup 10 --mix qa=0.5,think=0.1,tool=0.15,json=0.1,hello=0.15 "$@"
fi
