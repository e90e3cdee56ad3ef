"""Device query and fingerprint."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from rapydli.autotune.device import query
from rapydli.errors import ConfigError


def test_cpu_query_reads_cores_isa_and_caches() -> None:
    info = query("cpu")
    assert info.kind == "cpu"
    assert info.cores == len(os.sched_getaffinity(0))
    with open("/proc/cpuinfo") as fh:
        flags = fh.read()
    if " avx512f" in flags:
        assert info.isa == "avx512" and info.vector_lanes == 16 and info.vector_registers == 32
    elif " avx2" in flags:
        assert info.isa == "avx2" and info.vector_lanes == 8
    assert info.caches.get("L1d", 0) > 0
    assert info.threads == torch.get_num_threads()
    assert info.peak_gflops >= 0


def test_fingerprint_is_stable_and_changes_with_what_changes_measurements() -> None:
    a, b = query("cpu"), query("cpu")
    assert a.fingerprint() == b.fingerprint()
    assert replace(a, frequency_mhz=a.frequency_mhz + 100).fingerprint() == a.fingerprint()  # MHz drifts
    assert replace(a, threads=a.threads + 1).fingerprint() != a.fingerprint()
    other = "avx2" if a.isa != "avx2" else "avx512"  # this machine's own ISA varies (AVX-512 or not)
    assert replace(a, isa=other).fingerprint() != a.fingerprint()
    assert query("cpu", threads=1).threads == 1


def test_unknown_or_absent_devices_fail_with_config_error() -> None:
    with pytest.raises(ConfigError, match="device must be"):
        query("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="cuda"):
            query("cuda")
