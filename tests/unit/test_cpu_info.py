"""The one /proc/cpuinfo reader (runtime/cpu_info.py), on recorded files."""

from __future__ import annotations

from phasesplit.runtime import cpu_info

ZEN4 = """processor	: 0
vendor_id	: AuthenticAMD
model name	: AMD EPYC 9R14 96-Core Processor
flags		: fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512_bf16 avx512_vnni

processor	: 1
model name	: AMD EPYC 9R14 96-Core Processor
flags		: fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512_bf16 avx512_vnni
"""
ZEN3 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma f16c\n"


def test_fields_of_the_first_processor():
    assert cpu_info.model_name(ZEN4) == "AMD EPYC 9R14 96-Core Processor"
    assert {"avx512_bf16", "avx2"} <= cpu_info.flags(ZEN4)
    assert "avx512_bf16" not in cpu_info.flags(ZEN3)


def test_the_kind_that_picks_the_kernels():
    assert cpu_info.kind(ZEN4) == "avx512-bf16"
    assert cpu_info.kind(ZEN3) == "avx2"
    assert cpu_info.kind("processor\t: 0\nflags\t\t: fpu sse2\n") == "baseline"


def test_a_file_without_the_fields():
    assert cpu_info.flags("") == set()
    assert cpu_info.kind("no flags here") == "baseline"
    assert cpu_info.model_name("flags : avx2") != ""  # platform's name, or "unknown CPU"
