"""kvserve's compiled CPU ops (`kvserve/kernels/csrc/*.cpp`): build once, load, or say why not.

One torch C++ extension holds every kernel; `csrc/torch_bindings.cpp` registers them all
as `torch.ops.kvserve.*` (and the layer loop as `torch.classes.kvserve.DecoderLayers`),
and `load()` here is the one place that loads it. The modules beside this one, one per
`.cpp`, wrap its ops. It is built on first use (or ahead of time by
`python -m kvserve.kernels.build`, which `make` runs) into the kvserve cache, in a
folder keyed by the sources, torch version, compiler flags and CPU, so a changed kernel
or machine rebuilds. If the build fails, `available()` says so once and kvserve uses
its pure-PyTorch paths. `KVSERVE_CPU_KERNEL=0` turns the kernels off;
`KVSERVE_DISABLE_AMX=1` keeps them off AMX (`csrc/amx.h`), as on a CPU without it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvserve.config import cache_root
from kvserve.logger import logger

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cpp"))
EXT_NAME = "kvserve_cpu_ops"
STALE_LOCK_S = 900.0


def compile_flags() -> list[str]:
    """Flags for this machine: the vector ISA torch itself dispatches to, so at::vec uses it."""
    flags = ["-O3", "-fopenmp", "-DNDEBUG"]  # -fopenmp: at::parallel_for is an OpenMP pragma in a header
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-march=native")
        capability = torch.backends.cpu.get_cpu_capability()  # honours ATEN_CPU_CAPABILITY
        if capability in ("AVX512", "AVX2"):
            flags.append(f"-DCPU_CAPABILITY_{capability}")
    return flags


def _cpu_fingerprint() -> str:
    """-march=native code only runs on the CPU it was built on: key the build by its flags."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_dir() -> Path:
    """Cache folder for this source (and where it lies) + torch + flags + CPU; a change of any rebuilds.

    The sources' folder is part of the key: ninja's build file names the sources by path, so
    two checkouts sharing one folder would rebuild it in turn, each waiting on the other's lock.
    """
    key = hashlib.sha256(str(CSRC).encode())
    files = sorted(CSRC.glob("*.[ch]*"))  # sources and headers
    for part in (*(f.read_bytes() for f in files), torch.__version__.encode(), " ".join(compile_flags()).encode()):
        key.update(part)
    key.update(_cpu_fingerprint().encode())
    return cache_root() / "ext" / f"cpu_ops-{key.hexdigest()[:16]}"


def _ensure_ninja() -> None:
    """torch's load() runs `ninja` from PATH; a venv's ninja (pip install ninja) may not be on it."""
    if shutil.which("ninja"):
        return
    candidates = [Path(sys.executable).parent]
    try:
        import ninja  # the PyPI wheel

        candidates.append(Path(ninja.BIN_DIR))
    except (ImportError, AttributeError):
        pass
    for folder in candidates:
        if (folder / "ninja").exists():
            os.environ["PATH"] = f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"
            return


def _remove_stale_lock(lock: Path) -> None:
    """torch's build lock stays behind when a build is killed, and every later load then waits
    for it forever; a build takes minutes, so a lock older than STALE_LOCK_S is removed."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        logger.warning("removing %s, left %.0f s ago by a build that did not finish", lock, age)
        lock.unlink(missing_ok=True)


@functools.cache
def load() -> Any:
    """Build (or reuse the cached build of) the extension and return its ops namespace."""
    from torch.utils import cpp_extension

    _ensure_ninja()
    folder = build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    _remove_stale_lock(folder / "lock")
    cpp_extension.load(
        name=EXT_NAME,
        sources=[str(s) for s in SOURCES],
        extra_cflags=compile_flags(),
        extra_ldflags=["-fopenmp"],  # resolves to the libgomp torch already loaded
        build_directory=str(folder),
        is_python_module=False,  # registers torch.ops.kvserve.*; no pybind module
        verbose=os.environ.get("KVSERVE_LOG_LEVEL") == "DEBUG",
    )
    return torch.ops.kvserve


@functools.cache
def unavailable_reason() -> str | None:
    """None if the kernel can be used here, else why not (logged once)."""
    if os.environ.get("KVSERVE_CPU_KERNEL", "1") == "0":
        logger.info("CPU kernels off (KVSERVE_CPU_KERNEL=0); using the PyTorch paths")
        return "turned off by KVSERVE_CPU_KERNEL=0"
    try:
        load()
    except Exception as e:  # a missing compiler, headers, ninja...: fall back, don't fail
        lines = str(e).strip().splitlines() or [""]
        first_error = next((line for line in lines if "error:" in line), lines[-1])  # the compiler's own
        reason = f"{type(e).__name__}: {first_error.strip()}"
        logger.warning("CPU kernels unavailable (%s); using the PyTorch paths", reason)
        return reason
    return None


def available() -> bool:
    return unavailable_reason() is None


def build() -> tuple[Path, float, bool]:
    """Build now (ahead of serving): the build folder, seconds taken, and whether it was cached."""
    folder = build_dir()
    cached = any(folder.glob(f"{EXT_NAME}*.so"))
    start = time.perf_counter()
    load()
    return folder, time.perf_counter() - start, cached


def main() -> int:
    flags = " ".join(compile_flags())
    print(f"CPU kernels: {', '.join(s.name for s in SOURCES)}, flags {flags}", flush=True)
    try:
        folder, seconds, cached = build()
    except Exception as e:  # report the compiler's words, not a traceback
        print(f"build failed: {e}", file=sys.stderr)
        return 1
    ops = load()
    how = "already built, loaded" if cached else "built"
    print(f"{how} in {seconds:.1f} s: {folder} (vector ISA {ops.vector_isa()}, head dims {ops.supported_head_dims()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
