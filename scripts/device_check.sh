#!/usr/bin/env bash
# The CUDA paths in one short run, for a machine with a GPU (the development machines have none):
#   scripts/device_check.sh [OUT_DIR]
# Installs the project (the CUDA Mooncake wheel where nvidia-smi lists a GPU), then runs the kernel tests on CUDA
# (paged attention, MoE with FP8 expert tiles, the FP8 activation quantizer and GEMM: their torch twins are the
# oracles), and a load + decode of a V2.5-layout FP8 checkpoint with FP8 kept resident against dequantized at load.
# Everything it prints goes to OUT_DIR/device_check.log too.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-build/device_check}}
mkdir -p "$OUT"
exec > >(tee "$OUT/device_check.log") 2>&1
nvidia-smi -L || echo "no nvidia-smi: this script is for a GPU machine"
make install-dev >/dev/null
.venv/bin/python -c "import torch; print('cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
timeout 900 .venv/bin/python -m pytest -q tests/llm/test_fp8_kernels.py tests/llm/test_kernels.py tests/encoder/test_kernels_band_attention.py tests/encoder/test_kernels_patchify.py -x -p no:cacheprovider
CK="$OUT/v25-small"
[ -f "$CK/config.json" ] || .venv/bin/mimo-epd make-checkpoint "$CK" --like v2.5 --scale small
timeout 600 .venv/bin/python - "$CK" <<'PY'
import json, sys, time
import torch
from llm_backend.models import load_llm
from llm_backend.paged_attention import ContiguousKV

path = sys.argv[1]
out = {}
ids = torch.randint(9, 4096, (512,), generator=torch.Generator().manual_seed(0)).cuda()
for mode in ("keep", "dequantize"):
    t = time.perf_counter()
    m = load_llm(path, device="cuda", dtype=torch.bfloat16, fp8_weights=mode)
    load_s = time.perf_counter() - t
    kv = ContiguousKV(m.config)
    torch.cuda.synchronize(); t = time.perf_counter()
    logits = m(ids, torch.arange(512, device="cuda"), kv, logits_for="last")
    torch.cuda.synchronize(); prefill_s = time.perf_counter() - t
    toks, t = [], time.perf_counter()
    for _ in range(64):
        tok = int(logits[-1].argmax()); toks.append(tok)
        logits = m(torch.tensor([tok], device="cuda"), torch.tensor([kv.length], device="cuda"), kv, logits_for="last")
    torch.cuda.synchronize()
    out[mode] = {"load_s": round(load_s, 3), "prefill_512_s": round(prefill_s, 4),
                 "decode_tokens_per_s": round(64 / (time.perf_counter() - t), 1),
                 "resident_bytes": sum(p.numel() * p.element_size() for p in m.parameters()), "tokens": toks[:16]}
out["same_first_16_tokens"] = out["keep"].pop("tokens") == out["dequantize"].pop("tokens")
print(json.dumps(out))
PY
