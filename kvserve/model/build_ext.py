"""Build the CPU kernels ahead of time: `python -m kvserve.model.build_ext`.

The engine builds it on first use otherwise, which adds half a minute or so to the
first start. Exits non-zero if the build fails (the engine would fall back to
its PyTorch paths, slower but correct).
"""

from __future__ import annotations

import sys

from kvserve.model import cpu_ext


def main() -> int:
    flags = " ".join(cpu_ext.compile_flags())
    print(f"CPU kernels: {', '.join(s.name for s in cpu_ext.SOURCES)}, flags {flags}", flush=True)
    try:
        folder, seconds, cached = cpu_ext.build()
    except Exception as e:  # report the compiler's words, not a traceback
        print(f"build failed: {e}", file=sys.stderr)
        return 1
    ops = cpu_ext.load()
    how = "already built, loaded" if cached else "built"
    print(f"{how} in {seconds:.1f} s: {folder} (vector ISA {ops.vector_isa()}, head dims {ops.supported_head_dims()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
