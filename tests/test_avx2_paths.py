"""The kernels' AVX2 code on an AVX-512 host: their tests again, in a build for AVX2.

An AVX2-only CPU (AMD Zen 1-3) compiles loops of its own (`CPU_CAPABILITY_AVX2` in
csrc/, e.g. the paged decode kernel's fp32 scores) that an AVX-512 build leaves out, so
the suite on an AVX-512 host would never run them. torch dispatches to AVX2 under
`ATEN_CPU_CAPABILITY=avx2`, and the kernels build for what torch dispatches to
(`kernels/build.py`, a folder of its own), so a child pytest with that variable runs
the kernels' tests on the AVX2 code.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvserve.kernels import build

ROOT = Path(__file__).resolve().parent.parent  # the child runs here: node ids are relative to it
KERNEL_TESTS = [
    "tests/test_cpu_attention.py",
    "tests/test_sliding_window_attention.py",
    "tests/test_layer_ops.py",
    "tests/test_packed_linear.py",
    "tests/test_fused_layers.py",
    "tests/test_kv_kernels_int8.py",
]
# torch's own SDPA in bf16, which this test's prefill chunk reaches, packs for AVX-512
# (`pack_vnni2`) on a CPU with AVX512-BF16 whatever ATEN_CPU_CAPABILITY says, and then
# refuses to run under avx2; a real AVX2 CPU never takes that branch
TORCH_ONLY_FAILURES = ["tests/test_cpu_attention.py::test_mixed_batch_bfloat16[16]"]


@pytest.fixture(scope="module")
def avx2_env() -> dict[str, str]:
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("the host's own build already runs its widest code; AVX2 hosts run these tests as they are")
    if (reason := build.unavailable_reason()) is not None:
        pytest.skip(f"CPU kernels unavailable: {reason}")
    return {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}


def test_the_child_builds_the_avx2_code(avx2_env):
    isa = "from kvserve.kernels.build import load; print(load().vector_isa())"
    child = subprocess.run([sys.executable, "-c", isa], env=avx2_env, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.split()[-1] == "avx2"


def test_kernel_tests_pass_on_the_avx2_code(avx2_env):
    deselect = [arg for test in TORCH_ONLY_FAILURES for arg in ("--deselect", test)]
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *deselect]
    child = subprocess.run(
        [*args, *KERNEL_TESTS],
        env=avx2_env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
    assert " passed" in child.stdout.splitlines()[-1]
