"""The package's layering: no import cycle between modules, each package imports only the
layers below it (docs/architecture.md), and what a router or a client needs loads no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvserve"

# what each part of kvserve may import besides itself; the foundation modules import none
FOUNDATION = {
    "config", "logger", "outputs", "sampling_params", "engine_args", "tokenizer", "stop_strings", "detokenizer"
}  # fmt: skip
ALLOWED = {
    "kv_cache": {"logger"},
    "kv_events": {"kv_cache", "logger"},
    "kernels": {"config", "logger"},
    "layers": {"kernels", "outputs", "sampling_params"},
    "platforms": {"kernels", "layers", "logger"},
    "models": {"platforms", "layers", "kernels", "config", "logger"},
    "engine": {"models", "platforms", "layers", "kv_cache", "kv_events", *FOUNDATION},
    "server": {"engine", "kv_cache", "kv_events", *FOUNDATION},
    "bench": {"engine", "models", "platforms", "kv_cache", "kvserve", *FOUNDATION},
    # the torch-free parts of server (auth, protocol, errors, SSE): test_these_imports_leave_torch_out checks it
    "router": {"kv_cache", "kv_events", "server", "logger", "stop_strings", "detokenizer"},
    "entrypoints": {"server", "router", "bench", "engine", "models", *FOUNDATION},
}


def module_files() -> dict[str, Path]:
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def imports(path: Path, modules: dict[str, Path]) -> Iterator[str]:
    """Every kvserve module `path` imports, at the top, in a function or for type checking."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.split(".")[0] == "kvserve")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "kvserve":
            for a in node.names:  # `from kvserve.kernels import build` imports the module kvserve.kernels.build
                name = f"{node.module}.{a.name}"
                yield name if name in modules else node.module


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {m: set(imports(path, modules)) - {m} for m, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of imports as the list of modules along it, or None."""
    state: dict[str, str] = {}  # "open" while on the DFS stack, "done" after
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                return stack[stack.index(n) :] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def part(module: str) -> str:
    """kvserve.engine.scheduler -> engine; kvserve.config -> config; kvserve -> kvserve."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "kvserve"


def test_no_import_cycle_between_modules():
    assert find_cycle(import_graph()) is None, f"import cycle: {' -> '.join(find_cycle(import_graph()) or [])}"


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_each_package_imports_only_the_layers_below_it():
    wrong = sorted(
        f"{m} imports {n}"
        for m, targets in import_graph().items()
        for n in targets
        if part(m) in ALLOWED and part(n) != part(m) and part(n) not in ALLOWED[part(m)]
    )
    assert not wrong, "\n".join(wrong)


def test_foundation_modules_import_only_each_other():
    wrong = [f"{m} imports {n}" for m, ns in import_graph().items() if part(m) in FOUNDATION for n in ns]
    assert wrong == ["kvserve.engine_args imports kvserve.config"]


@pytest.mark.parametrize(
    "modules",
    [
        ["kvserve"],
        ["kvserve.kv_cache.kv_cache_manager", "kvserve.kv_cache.radix_cache", "kvserve.kv_cache.hash_chain_cache"],
        ["kvserve.kv_cache.tiers.store", "kvserve.kv_cache.tiers.host", "kvserve.kv_cache.tiers.disk"],
        ["kvserve.kv_cache.tiers.redis_tier", "kvserve.models.fingerprint"],
        ["kvserve.kv_events.wire", "kvserve.kv_events.publisher", "kvserve.kv_events.subscriber"],
        ["kvserve.server.protocol", "kvserve.sampling_params", "kvserve.config", "kvserve.engine_args"],
        ["kvserve.router.app", "kvserve.router.args"],
    ],
)
def test_these_imports_leave_torch_out(modules):
    code = f"import sys; import {', '.join(modules)}; print(sorted({{'torch', 'transformers'}} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"


def test_lazy_exports_load_on_first_use():
    code = "import kvserve, sys; before = 'torch' in sys.modules; kvserve.SamplingParams; print(before, kvserve.LLM)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.startswith("False <class 'kvserve.entrypoints.llm.LLM'>")
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        import kvserve

        kvserve.nope  # noqa: B018


def test_python_dash_m_kvserve_runs_the_cli():
    done = subprocess.run([sys.executable, "-m", "kvserve", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "serve" in done.stdout and "generate" in done.stdout
    done = subprocess.run([sys.executable, "-m", "kvserve", "bench", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "throughput" in done.stdout
