"""What /proc/cpuinfo says of this machine's CPU, read once (Linux; elsewhere nothing)."""

from __future__ import annotations

import functools


@functools.cache
def _first_cpu() -> dict[str, str]:
    """The first processor's fields (``vendor_id``, ``model name``, ``flags``, ...); {} where the
    file cannot be read."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break            # (the first processor's block ends at its blank line)
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def field(name: str) -> str:
    """One field of the first processor's block; "" where it has none."""
    return _first_cpu().get(name, "")


def flags() -> frozenset[str]:
    """The CPU's feature flags (``avx512_vnni``, ``amx_bf16``, ...)."""
    return frozenset(field("flags").split())


def vector_isa() -> str:
    """The widest vector instructions the CPU has that torch's kernels choose by ("amx", "avx512",
    "avx2"; "" for none of them or no /proc/cpuinfo): one processor name ("AMD EPYC" in a VM)
    covers CPUs whose kernels round differently."""
    have = flags()
    return next((isa for isa, flag in (("amx", "amx_tile"), ("avx512", "avx512f"), ("avx2", "avx2")) if flag in have), "")
