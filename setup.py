"""The package is described in pyproject.toml; this adds its one C extension, the block keys'
SHA-256 loop (kvserve/kv_cache/csrc/block_keys.c). It is optional: where it does not build (no C
compiler, no libcrypto.so.3), kvserve computes the same keys with hashlib, more slowly."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvserve.kv_cache._block_keys",
            ["kvserve/kv_cache/csrc/block_keys.c"],
            extra_link_args=["-l:libcrypto.so.3"],  # the runtime library itself: no -dev package needed
            optional=True,
        )
    ]
)
