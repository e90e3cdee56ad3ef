"""Device query: what the hardware allows (hard constraints) and a fingerprint for the cache.

CPU facts come from ``/proc/cpuinfo`` (model, SIMD flags, frequency), ``/sys`` (cache
sizes) and the scheduler's affinity mask (cores); GPU facts from ``torch.cuda`` (SMs,
shared memory per block, registers, max threads). The fingerprint hashes what changes
a measurement: the processor, its ISA, the thread count, the torch build and compiler.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from rapydli.errors import ConfigError
from rapydli.native import compiler_version

# widest vector register, in float32 lanes, for each ISA
_ISA_LANES = {"avx512": 16, "avx2": 8, "avx": 8, "sse": 4, "neon": 4, "scalar": 1}


@dataclass(frozen=True)
class DeviceInfo:
    """What the tuner knows about one device.

    Attributes
    ----------
    kind
        ``"cpu"`` or ``"cuda"``.
    name
        Processor or GPU model.
    cores
        Cores usable by this process (CPU) or streaming multiprocessors (GPU).
    isa
        Widest SIMD instruction set (``"avx512"``, ``"avx2"``, ...); ``"simt"`` on a GPU.
    vector_lanes
        float32 lanes of the widest vector register.
    vector_registers
        Architectural vector registers (32 with AVX-512, 16 with AVX2).
    caches
        Cache sizes in bytes by name (``"L1d"``, ``"L2"``, ``"L3"``).
    frequency_mhz
        Clock frequency where known (0.0 otherwise).
    threads
        Threads a measurement uses (part of the fingerprint).
    compiler
        The C compiler's version line, or "" when none is found.
    extra
        GPU limits: ``shared_memory_per_block``, ``registers_per_sm``, ``max_threads_per_block``.
    """

    kind: str
    name: str
    cores: int
    isa: str
    vector_lanes: int
    vector_registers: int
    caches: dict[str, int] = field(default_factory=dict)
    frequency_mhz: float = 0.0
    threads: int = 1
    compiler: str = ""
    torch: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def peak_gflops(self) -> float:
        """Estimated float32 peak: cores x frequency x lanes x 2 FMA pipes x 2 FLOP (CPU)."""
        if self.kind == "cpu":
            return min(self.cores, self.threads) * self.frequency_mhz / 1e3 * self.vector_lanes * 2 * 2
        return float(self.extra.get("peak_gflops", 0.0))

    def fingerprint(self) -> str:
        """A short hash of everything that changes a measurement on this device."""
        payload = {k: v for k, v in asdict(self).items() if k not in ("caches", "frequency_mhz")}  # MHz drifts
        digest = hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()
        return f"{self.kind}-{digest[:16]}"


def _cpuinfo() -> dict[str, str]:
    info: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor is enough
        key, _, value = line.partition(":")
        info[key.strip()] = value.strip()
    return info


def _isa(flags: set[str]) -> str:
    if "avx512f" in flags:
        return "avx512"
    for isa in ("avx2", "avx"):
        if isa in flags:
            return isa
    if "sse2" in flags:
        return "sse"
    if platform.machine() in ("aarch64", "arm64"):
        return "neon"
    return "scalar"


def _caches() -> dict[str, int]:
    caches: dict[str, int] = {}
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(base.glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        if kind == "Instruction":
            continue
        units = {"K": 1024, "M": 1024**2, "G": 1024**3}
        value = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        caches[f"L{level}{'d' if kind == 'Data' else ''}"] = value
    return caches


def _frequency(info: dict[str, str]) -> float:
    max_freq = Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq")
    try:
        return int(max_freq.read_text()) / 1e3
    except (OSError, ValueError):
        pass
    try:
        return float(info.get("cpu MHz", "0"))
    except ValueError:
        return 0.0


@cache
def cpu_info(threads: int | None = None) -> DeviceInfo:
    """Query this machine's CPU; ``threads`` defaults to torch's intra-op thread count."""
    import torch

    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    isa = _isa(flags)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return DeviceInfo(
        kind="cpu",
        name=info.get("model name", platform.processor() or platform.machine()),
        cores=cores,
        isa=isa,
        vector_lanes=_ISA_LANES[isa],
        vector_registers=32 if isa == "avx512" else 16,
        caches=_caches(),
        frequency_mhz=_frequency(info),
        threads=int(threads or torch.get_num_threads()),
        compiler=compiler_version(),
        torch=torch.__version__,
    )


def gpu_info(index: int = 0) -> DeviceInfo:
    """Query CUDA device ``index`` through torch (raises ConfigError when there is none)."""
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("device='cuda' was asked for but torch.cuda.is_available() is False; use device='cpu'")
    props = torch.cuda.get_device_properties(index)
    extra = {
        "shared_memory_per_block": getattr(props, "shared_memory_per_block_optin", 48 * 1024),
        "registers_per_sm": getattr(props, "regs_per_multiprocessor", 65536),
        "max_threads_per_block": getattr(props, "max_threads_per_block", 1024),
        "capability": f"{props.major}.{props.minor}",
        "memory": props.total_memory,
    }
    return DeviceInfo(
        kind="cuda",
        name=props.name,
        cores=props.multi_processor_count,
        isa="simt",
        vector_lanes=32,
        vector_registers=255,
        threads=1,
        torch=torch.__version__,
        extra=extra,
    )


def query(device: str = "cpu", threads: int | None = None) -> DeviceInfo:
    """Device facts for ``"cpu"`` or ``"cuda"`` (``"cuda:N"``)."""
    if device == "cpu":
        return cpu_info(threads)
    if device.startswith("cuda"):
        _, _, index = device.partition(":")
        return gpu_info(int(index or 0))
    raise ConfigError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
