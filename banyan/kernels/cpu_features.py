"""What the CPU offers: its /proc/cpuinfo flags (torch-free, so reports can name the ISA without loading torch)."""

from __future__ import annotations


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def isa(flags: set[str] | None = None) -> str:
    """The x86 vector extensions CPU timings depend on, e.g. "AVX-512 (VNNI, BF16)" or "AVX2": which kernels banyan
    builds and which defaults it takes follow them (docs/quantization.md), so every benchmark report names them."""
    flags = cpu_flags() if flags is None else flags
    if not flags:
        return "ISA unknown"
    widest = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    extras = [name for flag, name in (("avx512_vnni", "VNNI"), ("avx_vnni", "AVX-VNNI"), ("avx512_bf16", "BF16"),
                                      ("amx_tile", "AMX")) if flag in flags]
    return f"{widest} ({', '.join(extras)})" if extras else widest
