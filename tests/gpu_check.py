"""``make gpu-check``: the GPU tests and the GPU benchmark in one command on the GPU machine.

The GPU machine starts from its own image (Python 3.12, torch with CUDA, triton, mpi4py,
pytest; no network, no ``mpiexec``, no ipyparallel). What it lacks travels from here as
wheels in ``.whl/`` (``make gpu-wheels`` downloads them: the MPICH wheel, which brings
``mpiexec`` and ``libmpi``, and an mpi4py built for Python 3.12); they are installed into
``/tmp/site`` there. Then, each under its own time limit:

1. ``pytest -m gpu`` over the files holding GPU tests (``tests/test_gpu.py`` and the GPU
   tests of the communicator and the Triton candidate), with a JUnit report;
2. ``rapydli bench gpu`` (tuned convolutions against cuDNN, training steps per second).

The summary (``summary.json``, and one line on stdout starting ``gpu-check:``) goes to
``--out``; the logs beside it. ``--dry-run`` lists what would be carried and run.
Exit status 0 only when every test passed (skips allowed) and the benchmark ran.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = Path(os.environ.get("RAPYDLI_GPU_CHECK_WHEELS", ROOT / ".whl"))  # another folder: a rehearsal without them
SITE = Path("/tmp/site")
TEST_FILES = ("tests/test_gpu.py", "tests/test_comm.py", "tests/test_autotune_candidates.py")
TESTS_LIMIT_S, BENCH_LIMIT_S = 240, 150
CARRY_LIMIT_BYTES = 64 * 2**20


def tracked_bytes() -> int:
    """Bytes of the files git tracks plus the untracked ones it does not ignore (what travels without ``carry``)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    return sum((ROOT / name.decode()).stat().st_size for name in listed if name and (ROOT / name.decode()).is_file())


def environment() -> dict[str, str]:
    """This process's environment with the carried wheels' site, ``mpiexec`` and ``libmpi`` in front."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAPYDLI_HOME=str(Path("/tmp/rapydli-gpu-home")))
    # the image's own MPI is Debian's Open MPI (seen 2026-11-28), whose mpiexec refuses root unless told twice;
    # the check runs as root there. Single-copy (CMA) transfers off: ptrace rules of a VM must not fail a rank.
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_btl_vader_single_copy_mechanism="none"
    )
    paths = [str(SITE), str(ROOT)] if SITE.is_dir() else [str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if (SITE / "bin").is_dir():
        env["PATH"] = f"{SITE / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    if (SITE / "lib" / "libmpi.so.12").is_file():
        env["LD_LIBRARY_PATH"] = f"{SITE / 'lib'}{os.pathsep}{env.get('LD_LIBRARY_PATH', '')}"
        env["MPI4PY_LIBMPI"] = str(SITE / "lib" / "libmpi.so.12")
    return env


def commands(out: Path) -> list[tuple[str, list[str], float]]:
    """``(name, argv, limit in seconds)`` of each step, in order."""
    wheels = sorted(str(p) for p in WHEELS.glob("*.whl"))
    steps: list[tuple[str, list[str], float]] = []
    if wheels:
        steps.append(
            (
                "install",
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "install",
                    "-q",
                    "--no-index",
                    "--no-deps",
                    "--no-compile",
                    "--no-cache-dir",
                    "--upgrade",
                    "--target",
                    str(SITE),
                    *wheels,
                ],
                120,
            )
        )
    steps.append(("facts", [sys.executable, "-c", FACTS], 60))
    steps.append(
        (
            "tests",
            [
                sys.executable,
                "-m",
                "pytest",
                "-m",
                "gpu",
                *TEST_FILES,
                "-p",
                "no:cacheprovider",
                "-o",
                "addopts=",
                "-ra",
                "-q",
                "--durations=15",
                f"--junitxml={out / 'junit.xml'}",
            ],
            TESTS_LIMIT_S,
        )
    )
    steps.append(
        ("bench", [sys.executable, "-m", "rapydli.bench.gpu", "--json", str(out / "bench.json")], BENCH_LIMIT_S)
    )
    return steps


FACTS = """
import json, shutil, subprocess, torch
facts = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": torch.cuda.device_count(),
         "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
         "mpiexec": shutil.which("mpiexec")}
try:
    import triton; facts["triton"] = triton.__version__
except ImportError:
    facts["triton"] = None
from mpi4py import MPI
facts["mpi"] = MPI.Get_library_version().splitlines()[0]
print(json.dumps(facts))
"""


def junit_counts(path: Path) -> dict[str, object]:
    """Passed, failed (failures and errors), skipped and the failing tests' ids from a JUnit report."""
    if not path.is_file():
        return {"passed": 0, "failed": 0, "skipped": 0, "failing": ["(no JUnit report: pytest did not finish)"]}
    cases = ET.parse(path).getroot().iter("testcase")
    counts: dict[str, object] = {"passed": 0, "failed": 0, "skipped": 0}
    failing, skipped = [], []
    for case in cases:
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failing.append(name)
        elif (skip := case.find("skipped")) is not None:
            skipped.append(f"{name}: {skip.get('message', '')}")
        else:
            counts["passed"] = int(counts["passed"]) + 1  # type: ignore[call-overload]
    counts.update(failed=len(failing), skipped=len(skipped), failing=failing, skips=skipped)
    return counts


def summary_line(summary: dict) -> str:
    tests = summary["tests"]
    line = f"gpu-check: {tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped"
    bench = summary.get("bench") or {}
    if bench:
        line += (
            f"; tuned/cuDNN forward {bench.get('tuned_vs_cudnn_median_over_layers', float('nan')):.3g}x median over "
            f"{bench.get('layers')} layers ({bench.get('tuned_vs_cudnn_range_over_layers')}), Triton/cuDNN "
            f"{bench.get('triton_vs_cudnn_median_over_layers') or float('nan'):.3g}x; resnet_mini steps/s fp32 "
            f"{bench.get('resnet_steps_per_s_fp32', float('nan')):.4g}, bf16 {bench.get('resnet_steps_per_s_bf16', float('nan')):.4g}"
        )
    else:
        line += "; the benchmark did not run"
    return line + f" ({summary['seconds']:.0f} s)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for summary.json, the JUnit report and the logs"
    )
    parser.add_argument("--dry-run", action="store_true", help="list what would be carried and run; run nothing")
    args = parser.parse_args()
    out: Path = args.out
    steps = commands(out)
    if args.dry_run:
        wheels = sorted(WHEELS.glob("*.whl"))
        carried = tracked_bytes() + sum(p.stat().st_size for p in wheels)
        print(f"carried: the working tree ({tracked_bytes() / 2**20:.1f} MiB) and .whl/ ({len(wheels)} wheels):")
        for wheel in wheels:
            print(f"  {wheel.name} ({wheel.stat().st_size / 2**20:.1f} MiB)")
        if not wheels:
            print("  (none: run `make gpu-wheels` first; without mpiexec the MPI tests fail there)")
        print(
            f"  in all {carried / 2**20:.1f} MiB of the {CARRY_LIMIT_BYTES // 2**20} MiB allowed"
            + ("" if carried <= CARRY_LIMIT_BYTES else ": TOO MUCH")
        )
        for name, argv, limit in steps:
            print(f"{name} (at most {limit:.0f} s): {shlex.join(argv)}")
        return 0 if carried <= CARRY_LIMIT_BYTES else 1
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    started = time.monotonic()
    results: dict[str, dict] = {}
    facts: dict = {}
    for name, argv, limit in steps:
        began = time.monotonic()
        with open(out / f"{name}.log", "w") as log:
            try:
                rc = subprocess.run(
                    argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=limit
                ).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        results[name] = {"rc": rc, "seconds": round(time.monotonic() - began, 1)}
        text = (out / f"{name}.log").read_text(errors="replace")
        print(f"--- {name}: rc={rc} in {results[name]['seconds']} s", flush=True)
        print(text[-6000:] if rc else text[-1500:], flush=True)
        if name == "facts" and rc == 0:
            facts = json.loads(text.strip().splitlines()[-1])
        if name == "install" and rc != 0:
            break
    bench_path = out / "bench.json"
    summary = {
        "facts": facts,
        "steps": results,
        "tests": junit_counts(out / "junit.xml"),
        "bench": json.loads(bench_path.read_text())["summary"] if bench_path.is_file() else None,
        "seconds": time.monotonic() - started,
    }
    summary["line"] = summary_line(summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(summary["line"], flush=True)
    ok = summary["tests"]["failed"] == 0 and results.get("tests", {}).get("rc") == 0 and summary["bench"] is not None
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
