# The README's two commands: `make demo` (the main job: 4 ranks train through the embedded
# switch) and `make test` (the whole suite). `make check`: lint (ruff, cython-lint) and the
# unit tests that need no launcher (pytest -m "not mpi and not slow"), in about a minute
# (CI, .ci/run, runs it before the suite); `make lint` the linters alone.
# `make bench` runs every benchmark under bench/ and saves their JSON in bench/results/;
# `make netsim` the emulated-network benchmark (quick mode).
# Each sets up .venv on first use (and again when the package's metadata changes).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test lint check bench netsim clean

$(STAMP): setup.cfg setup.py pyproject.toml constraints.txt $(wildcard _fast/*.pyx _fast/*.pxd _fast/*.pxi _fast/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[mpich,test,dev,torch,p4,bench]'
	touch $@

# The emulated-network benchmark and its test drop packets with nftables (Debian package);
# only root can install it, or use it: `make test` installs it only when run as root, and
# elsewhere those tests skip and say why (the stamp is made only once it is installed).
NFT_STAMP := $(VENV)/.nftables
$(NFT_STAMP): $(STAMP)
	if [ "$$(id -u)" = 0 ]; then { command -v nft >/dev/null || \
		(apt-get update -qq && apt-get install -y -qq nftables); } && touch $@; fi
AS_ROOT := $(filter 0,$(shell id -u))

# The P4 toolchain (p4c-bm2-ss, simple_switch_grpc) for the tests marked bmv2: put on PATH
# where ../shared/p4-toolchain/build.sh installed it (or P4TOOLS_DIR names another
# place); without it those tests skip and say why.
P4TOOLS_DIR ?= /opt/p4tools
ifneq ($(wildcard $(P4TOOLS_DIR)/bin/simple_switch_grpc),)
export PATH := $(P4TOOLS_DIR)/bin:$(PATH)
export LD_LIBRARY_PATH := $(P4TOOLS_DIR)/lib$(if $(LD_LIBRARY_PATH),:$(LD_LIBRARY_PATH))
endif
export P4TOOLS_DIR

demo: $(STAMP)
	$(VENV)/bin/ina-run -np 4 -- $(PY) examples/train_mlp.py --compare-ring

test: $(STAMP) $(if $(AS_ROOT),$(NFT_STAMP))
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/cython-lint _fast/

check: lint
	$(PY) -m pytest -m "not mpi and not slow"

bench: $(STAMP)
	mkdir -p bench/results
	$(PY) -m pytest -p no:cacheprovider bench/test_fast_path.py --benchmark-json=bench/results/fast_path.json
	$(PY) -m bench.mpi -n 4
	$(PY) -m bench.mpi -n 4 bench/test_horovod.py --benchmark-json=bench/results/horovod-4.json
	$(PY) -m bench.mpi -n 2 bench/test_call_cost.py --benchmark-json=bench/results/call_cost-2.json
	$(PY) -m bench.mpi -n 4 bench/test_call_cost.py --benchmark-json=bench/results/call_cost-4.json
	$(PY) -m bench.call_breakdown
	$(PY) -m bench.loadgen_build
	$(PY) -m bench.switch_ceiling
	$(PY) -m bench.udp_ceiling
	$(PY) -m bench.host_path
	$(PY) -m bench.striping
	$(PY) -m bench.quantization_error

# INA against the ring, MPI and gloo on emulated shaped links (namespaces; needs root).
netsim: $(STAMP) $(NFT_STAMP)
	$(PY) -m bench.netsim --quick

clean:
	rm -rf $(VENV) build *.egg-info

# Everything only a GPU runs, for the first machine with one: the CUDA tests (any skip
# fails it) and the staging benchmark, then a summary (bench/gpu_check.py). Without a
# GPU, or with torch's CPU build, it says so and fails.
.PHONY: gpu-check
gpu-check: $(STAMP)
	$(PY) -m bench.gpu_check
