"""The machine a benchmark ran on, as one JSON-able dict: added to every `mimo-epd bench` JSON (cli/bench.py),
so two runs on two machines can be compared and a table in docs/benchmarks.md can say which machine it is.

What goes in is what changes results on a CPU deployment: the CPU model and its family/model numbers (two
"2-vCPU" machines of one cloud kind can be different microarchitectures), the cores this process may run on,
the SIMD flags torch's kernels dispatch on (avx2, avx512f, avx512_vnni, amx), torch's version, its intra-op
thread count and the instruction set it picked, and the image stack (Pillow or pillow-simd, the libjpeg-turbo
version it links, simplejpeg). Every probe that cannot answer on this system gives None; nothing here raises.
"""

from __future__ import annotations

import os
import platform
from importlib import metadata

from mimo_epd.common.proc_stat import usable_cores

SIMD_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def parse_cpuinfo(text: str) -> dict:
    """The first processor's entry of a /proc/cpuinfo text: model name, family and model numbers, SIMD flags."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor is enough: a VM's vCPUs are alike
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())

    def number(key: str) -> int | None:
        v = fields.get(key, "")
        return int(v) if v.isdigit() else None

    return {
        "cpu_model": fields.get("model name") or None,
        "cpu_vendor": fields.get("vendor_id") or None,
        "cpu_family": number("cpu family"),
        "cpu_model_number": number("model"),
        "simd": {f: f in flags for f in SIMD_FLAGS},
    }


def _cpuinfo() -> dict:
    try:
        with open("/proc/cpuinfo") as f:
            return parse_cpuinfo(f.read())
    except OSError:
        return {"cpu_model": platform.processor() or None, "cpu_family": None, "cpu_model_number": None, "simd": {}}


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _image_stack() -> dict:
    out: dict = {"pil": None, "pil_build": None, "libjpeg_turbo": None, "simplejpeg": _dist_version("simplejpeg")}
    try:
        import PIL
        from PIL import features

        out["pil"] = PIL.__version__
        out["pil_build"] = "pillow-simd" if _dist_version("pillow-simd") else "pillow"
        out["libjpeg_turbo"] = features.version("libjpeg_turbo") if features.check_feature("libjpeg_turbo") else None
    except ImportError:
        pass
    return out


def _torch() -> dict:
    try:
        import torch
    except ImportError:
        return {"torch": None}
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except AttributeError:
        capability = None
    return {
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "torch_cpu_capability": capability,
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }


def machine_facts() -> dict:
    facts = _cpuinfo()
    facts.update(
        {
            "cores": usable_cores(),
            "cpu_count": os.cpu_count(),
            "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
            "python": platform.python_version(),
            "platform": platform.platform(),
        }
    )
    facts.update(_torch())
    facts.update(_image_stack())
    return facts
