# tf_ipu: every target sets itself up (venv, install, op library, protocol stubs).
#   make demo   - train a small Keras CNN on an emulated IPU and print the estimates
#   make test   - the test suite
#   make test-isa-capped - the test suite with the host's instruction set capped (no AVX512)
#   make bench  - benchmarks (full sizes)
#   make lint   - ruff
#   make fuzz   - coverage-guided fuzzing (atheris) of each target in tests/fuzz/ for
#                 FUZZ_SECONDS (default 120) each; new inputs go to FUZZ_SCRATCH, crash
#                 reproducers to tests/fuzz/crashes/<target>/ (`make test` replays them)

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

PROTO_SRC := $(wildcard protos/device_server/protocol/*.proto)
PROTO_OUT := $(patsubst protos/%.proto,%_pb2.py,$(PROTO_SRC))
OPS_SRC   := $(wildcard ops/cc/ops/*.cc ops/cc/kernels/*.cc ops/cc/kernels/*.h)
OPS_LIB   := ops/python/_ipu_ops.so

.PHONY: all venv build protos ops test test-isa-capped demo bench lint fuzz clean

all: build

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	touch $(STAMP)

venv: $(STAMP)

protos: $(PROTO_OUT)

$(PROTO_OUT): device_server/protocol/%_pb2.py: protos/device_server/protocol/%.proto $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $<

ops: $(OPS_LIB)

# The op library is built with TensorFlow's own compile and link flags.
$(OPS_LIB): $(OPS_SRC) $(STAMP)
	$(PY) ops/build.py --out $@

$(VENV)/.dev-installed: $(STAMP) setup.py
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

build: protos ops $(VENV)/.dev-installed

test: build
	$(PY) -m pytest -q tests

# The suite as on a CPU without AVX512: XLA at AVX2, numpy's AVX512 kernels off, numba generic.
test-isa-capped: build
	$(PY) tests/isa_caps.py $(PY) -m pytest -q tests

demo: build
	$(PY) examples/demo.py

bench: build
	$(PY) bench/run.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

FUZZ_SECONDS ?= 120
FUZZ_TARGETS ?= compile hlo onnx disk_cache framing
FUZZ_SCRATCH ?= $(or $(TMPDIR),/tmp)/tf_ipu-fuzz

# Each target searches from its committed seeds (tests/fuzz/corpus/<target>, read only) and
# what earlier runs kept in the scratch folder; a crash, an INTERNAL-mapped error, a hang
# (-timeout) or runaway memory (-rss_limit_mb) leaves its input in tests/fuzz/crashes/.
fuzz: build
	@status=0; for t in $(FUZZ_TARGETS); do \
	  mkdir -p $(FUZZ_SCRATCH)/$$t tests/fuzz/crashes/$$t; \
	  echo "== fuzz $$t for $(FUZZ_SECONDS) s"; \
	  $(PY) tests/fuzz/fuzz_$$t.py -max_total_time=$(FUZZ_SECONDS) -timeout=30 \
	    -rss_limit_mb=4096 -print_final_stats=1 -artifact_prefix=tests/fuzz/crashes/$$t/ \
	    $(FUZZ_SCRATCH)/$$t tests/fuzz/corpus/$$t || status=1; \
	done; exit $$status

clean:
	rm -rf build dist *.egg-info $(OPS_LIB) device_server/protocol/*_pb2*.py device_server/protocol/*_pb2.pyi
