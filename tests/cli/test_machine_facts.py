"""The machine facts every benchmark JSON carries: parsed from /proc/cpuinfo text, and complete on this host."""

import json

from mimo_epd.bench.machine import SIMD_FLAGS, machine_facts, parse_cpuinfo

EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx avx2 fma bmi2

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx avx2 fma bmi2
"""

SAPPHIRE = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8480C
flags\t\t: avx2 avx512f avx512_vnni avx512_bf16 amx_tile amx_bf16 amx_int8
"""


def test_parse_epyc():
    f = parse_cpuinfo(EPYC)
    assert f["cpu_model"] == "AMD EPYC 7B13" and f["cpu_vendor"] == "AuthenticAMD"
    assert (f["cpu_family"], f["cpu_model_number"]) == (25, 1)
    assert f["simd"] == {**dict.fromkeys(SIMD_FLAGS, False), "avx2": True}


def test_parse_amx():
    f = parse_cpuinfo(SAPPHIRE)
    assert (f["cpu_family"], f["cpu_model_number"]) == (6, 143)
    assert all(f["simd"].values())


def test_parse_missing_fields():
    f = parse_cpuinfo("processor\t: 0\n")
    assert f["cpu_model"] is None and f["cpu_family"] is None and not any(f["simd"].values())


def test_machine_facts_here():
    f = machine_facts()
    json.dumps(f)  # JSON-able as it is
    assert f["cores"] >= 1 and f["torch_threads"] >= 1 and f["torch"]
    assert set(f["simd"]) == set(SIMD_FLAGS)
    assert f["pil_build"] in ("pillow", "pillow-simd") and f["pil"]
    for key in ("cpu_model", "cpu_family", "cpu_model_number", "libjpeg_turbo", "simplejpeg", "torch_cpu_capability"):
        assert key in f
