# `make demo` and `make test` set everything up on a fresh machine (CPU-only is fine).
VENV ?= .venv
PY := $(VENV)/bin/python
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC := $(if $(HAS_GPU),torch,torch==2.13.0)
INTERPRET := $(if $(HAS_GPU),,TRITON_INTERPRET=1)

.PHONY: demo test test-gpu clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,plot,hf]"
	touch $@

demo: $(VENV)/.installed
	$(INTERPRET) $(PY) -m exl3moe.cli demo

test: $(VENV)/.installed
	$(INTERPRET) $(PY) -m pytest -q -m "not gpu" -p no:cacheprovider -n 2 --dist loadfile

test-gpu:
	PYTHONPATH=src python3 -m pytest -q -m gpu -p no:cacheprovider

clean:
	rm -rf $(VENV)
