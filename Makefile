# The README's two commands: `make demo` (the main job: 4 ranks train through the embedded
# switch) and `make test` (the whole suite). `make check`: lint (ruff, cython-lint) and the
# unit tests that need no launcher (pytest -m "not mpi and not slow"), in a few minutes
# (CI, .ci/run, runs it before the suite); `make lint` the linters alone.
# `make bench` runs the benchmarks bench/ holds (bench/__init__.py: by kind) and saves
# their JSON in bench/results/: every microbenchmark of bench/micro/ at the ranks it
# declares, then every command of bench/ceilings/ and bench/loopback/ (a module with a
# main(); a *_ranks module is what a job's ranks run). `make netsim` the emulated
# cluster's benchmark (bench/cluster/, quick mode; needs root).
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
# The open Tofino compiler (p4c-barefoot, `build.sh tofino`) for the tests marked tofino.
ifneq ($(wildcard $(P4TOOLS_DIR)/tofino/bin/p4c-barefoot),)
export PATH := $(PATH):$(P4TOOLS_DIR)/tofino/bin
export LD_LIBRARY_PATH := $(LD_LIBRARY_PATH):$(P4TOOLS_DIR)/tofino/lib
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

BENCH_COMMANDS = $(subst /,.,$(basename $(filter-out %_ranks.py %/chaos.py,\
	$(shell grep -lE '^def main\b' bench/ceilings/*.py bench/loopback/*.py))))

bench: $(STAMP)
	mkdir -p bench/results
	$(PY) -m bench.micro
	set -e; for command in $(BENCH_COMMANDS); do echo "== $$command"; $(PY) -m $$command; done

# INA against the ring, MPI and gloo on emulated shaped links (namespaces; needs root).
netsim: $(STAMP) $(NFT_STAMP)
	$(PY) -m bench.cluster.netsim --quick

clean:
	rm -rf $(VENV) build *.egg-info

# Everything only a GPU runs, for the first machine with one: the CUDA tests (any skip
# fails it) and the staging benchmark, then a summary (bench/gpu/gpu_check.py). Without a
# GPU, or with torch's CPU build, it says so and fails.
.PHONY: gpu-check
gpu-check: $(STAMP)
	$(PY) -m bench.gpu.gpu_check
