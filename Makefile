# pipeinfer — install, build, test and benchmark entry points.
# `make install` is idempotent: a second run reuses the venv, the llama-cpp-python wheel and the CMake build.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
BUILD  := build/native
# llama-cpp-python is built from source once per set of ggml flags (about 7 minutes on 2 cores).
export CMAKE_BUILD_PARALLEL_LEVEL ?= 2

.PHONY: bench-serve-recovery install deps native demo test test-slow test-properties fuzz asan bench bench-modes bench-grounded bench-native bench-native-gemma3 bench-network bench-cluster bench-prefix-reuse bench-parallel bench-topologies fault-matrix soak llama-rpc bench-rpc clean help

help:
	@echo "make install      create $(VENV), install pinned deps, build the native extension (GGML_CPU=all: every CPU variant, for mixed clusters)"
	@echo "make demo         install, pull the default model, run the main job"
	@echo "make test         run the test suite (pulls smollm2-135m-instruct and gemma3-270m once, 351 MB)"
	@echo "make test-slow    run the slow tests on the Qwen pair (pulls qwen-coder once, 1.6 GB)"
	@echo "make fuzz         fuzz every GGUF reader, FUZZ_RUNS inputs each (default 100000: about 25 minutes for all three on 2 quiet cores)"
	@echo "make asan         native extension with ASan+UBSan: native tests, fuzz replay, 2-rank generate"
	@echo "make test-properties  200 random generate command lines (hypothesis), each success or one Error: line"
	@echo "make bench        the modes vs llama.cpp (updates BENCHMARKS.md), then every topology on the default and grounded prompts"
	@echo "make bench-grounded grounded prompts (answers copied from the prompt): pipeinfer vs llama.cpp and its prompt lookup"
	@echo "make bench-native native layer engine vs llama.cpp"
	@echo "make bench-prefix-reuse  TTFT of a second chat turn with and without prefix reuse"
	@echo "make bench-parallel serve --parallel against the FIFO server at 1/2/4/8 clients, and the load policies"
	@echo "make bench-native-gemma3 native layer engine vs llama.cpp on Gemma 3 270M"
	@echo "make bench-topologies job shapes side by side: BENCH_SUITE=overhead|topologies|threads|pages|drafts (Qwen pair)"
	@echo "make bench-network modes on 2 and 3 emulated hosts at 1gbit/100mbit/10mbit vs shared memory (root)"
	@echo "make bench-cluster the scaling curve: 1-8 emulated hosts with their own CPU (2/N cores each), every mode and draft, CLUSTER_REPEAT runs a row (root)"
	@echo "make bench-serve-recovery  serve losing a node on 4 emulated hosts x 0.5 CPU (Qwen pair): answers vs fault-free, time without a pipeline (root, about 6 minutes)"
	@echo "make llama-rpc    build llama.cpp's rpc-server, llama-completion, llama-speculative into build/llama-rpc (from the PyPI sdist)"
	@echo "make bench-rpc    llama.cpp over RPC on a running emulated cluster vs pipeinfer on the same hosts (root)"
	@echo "make fault-matrix every message tag x drop/delay/dup/kill/stall in real jobs (about 20 minutes)"
	@echo "make soak         one job serving 1,000 requests: no KV, memory, fd or thread leak (about 20 minutes)"

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade "pip>=24"

# ggml's build for this CPU (scripts/install_llama_cpp.py): native, or portable (GGML_NATIVE=OFF, the
# CPU's features named, no AMX) on a CPU that reports AMX or with PIPEINFER_GGML_PORTABLE=1. The file
# is rewritten only when that choice changes, so the stamp below reruns only then.
# GGML_CPU=all: ggml's CPU backend for every x86 variant (GGML_BACKEND_DL + GGML_CPU_ALL_VARIANTS, as
# llama.cpp's release builds), the best for the CPU loaded at run time: one install for nodes of
# different CPUs (docs/cluster.md). The venv remembers it; GGML_CPU=one goes back to one build.
ifneq ($(GGML_CPU),)
export PIPEINFER_GGML_VARIANTS := $(GGML_CPU)
endif
$(VENV)/.ggml-flags: FORCE | $(PY)
	@$(PY) scripts/install_llama_cpp.py flags

# A stamp keeps the second `make install` from touching pip at all when nothing changed.
# llama-cpp-python is built (once per set of flags, kept in ~/.cache/pipeinfer/wheels) and installed
# first, so pip never builds it from its own cache; the probe then runs a 320-token prompt on
# quantized weights through it and rebuilds it portable if it dies of SIGILL.
$(VENV)/.deps-stamp: pyproject.toml scripts/install_llama_cpp.py $(VENV)/.ggml-flags | $(PY)
	$(PY) scripts/install_llama_cpp.py install
	$(PIP) install --quiet -e ".[dev]"
	$(PY) scripts/install_llama_cpp.py probe
	@touch $@

deps: $(VENV)/.deps-stamp

native: deps
	@cmake -S native -B $(BUILD) -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE=$(abspath $(PY)) \
	  -DCMAKE_PREFIX_PATH="$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])');$$($(PY) -m pybind11 --cmakedir)" > /dev/null
	cmake --build $(BUILD) --parallel 2
	cmake --install $(BUILD) > /dev/null

install: native
	@$(PY) -c "import pipeinfer_cli._native as n; print('pipeinfer installed; native extension linked against ggml', n.ggml_version(), file=__import__('sys').stderr)"

# The answer ends by itself (137 tokens with SmolLM2: the function, then a short explanation);
# -n 256 only bounds a runaway.
demo: install
	$(VENV)/bin/pipeinfer models pull smollm2-135m-instruct
	$(VENV)/bin/pipeinfer generate smollm2-135m-instruct --draft lookup --mode pipeinfer --ranks 2 -n 256 \
	  --chat "$$(printf '%s\n' 'Add type hints and a docstring to this Python function, and return the whole function:' '' \
	    'def is_prime(n):' '    if n < 2:' '        return False' '    for i in range(2, int(n ** 0.5) + 1):' \
	    '        if n % i == 0:' '            return False' '    return True')"

test: install
	$(PY) -m pytest -q

test-slow: install
	$(PY) -m pytest -q -m slow

# Fuzzing the GGUF readers (fuzz/fuzz_gguf.py): metadata (inspect, planning), native (a layer range
# through the binding), tokenizer (llama.cpp's vocabulary, chat template). A target stops at its
# first crash, hang (> 5 s) or memory blow-up; figures in build/fuzz/summary.json.
FUZZ_RUNS    ?= 100000
FUZZ_TARGETS ?= metadata native tokenizer
fuzz: install
	$(PY) fuzz/campaign.py --runs $(FUZZ_RUNS) $(FUZZ_TARGETS)

# AddressSanitizer + UBSan build of native/ in build/native-asan (the normal build is untouched).
asan: install
	PY=$(PY) scripts/asan.sh

# The property-based bad-input test with fresh random examples (make test runs 10 fixed ones).
PROPERTY_EXAMPLES ?= 200
test-properties: install
	PIPEINFER_PROPERTY_EXAMPLES=$(PROPERTY_EXAMPLES) PIPEINFER_PROPERTY_FRESH=1 $(PY) -m pytest -q tests/test_generate_properties.py

clean:
	rm -rf build $(VENV) src/pipeinfer_cli/_native*.so

FORCE:

# Native layer engine vs llama-cpp-python on the Qwen pair, 1 and 2 threads (prints a table + JSON).
BENCH_NATIVE_ARGS ?= --model qwen2.5-coder-0.5b-instruct --model qwen2.5-coder-1.5b-instruct --threads 1,2
bench-native: install
	$(PY) -m benchmarks.native $(BENCH_NATIVE_ARGS) --json build/bench_native.json

# The same on Gemma 3 270M (sliding-window attention, tied 262,144-row LM head), 1 and 2 threads.
bench-native-gemma3: install
	$(PY) -m benchmarks.native --model gemma3-270m --threads 1,2 --markdown build/bench_native_gemma3.md --json build/bench_native_gemma3.json

# serve --parallel against today's FIFO server (its default split, balanced in time for the load, with
# plan --parallel's prediction beside it; then the split picked by hand), the load policies, and batching
# two rows in one graph (BENCHMARKS.md, "Parallel requests").
bench-parallel: install
	@mkdir -p build
	$(PY) -m benchmarks.parallel qwen2.5-coder-0.5b-instruct --draft lookup --ranks 2 --levels 1,2 --limit 8 -n 64 --json build/parallel_default.json
	$(PY) -m benchmarks.parallel qwen2.5-coder-0.5b-instruct --draft lookup --ranks 2 3 --levels 1,2,4,8 --limit 8 -n 64 --split 2=0.65,0.35 --json build/parallel.json
	$(PY) -m benchmarks.parallel qwen2.5-coder-0.5b-instruct --draft lookup --ranks 2 3 --modes pipeinfer --levels 1,2 --policies --prompts grounded --limit 6 -n 64 --split 2=0.65,0.35 --json build/parallel_policies.json
	$(PY) -m benchmarks.parallel_batch qwen2.5-coder-0.5b-instruct --ctx 512 --json build/parallel_batch.json

# Time to first token of a second chat turn, with and without prefix reuse (BENCHMARKS.md, "Prefix reuse").
bench-prefix-reuse: install
	@mkdir -p build
	$(PY) -m benchmarks.prefix_reuse smollm2-135m-instruct --ranks 2 --repeat 5 --json build/prefix_reuse_smollm2.json
	$(PY) -m benchmarks.prefix_reuse qwen2.5-coder-1.5b-instruct --ranks 2 --repeat 2 --json build/prefix_reuse_qwen15.json

# Job shapes side by side, in alternated rounds (benchmarks/topologies.py): `overhead` (iterative on
# 1 rank against 2), `topologies` (iterative and pipeinfer on each placement of the Qwen pair, with
# llama.cpp as reference), `threads` (ranks given their share of the cores or all of them), `pages`
# (huge pages or not), `drafts` (each draft on each topology). `--report cores|overhead FILE...` on
# its JSON afterwards: CPU per committed token, or the wall time outside the layers' compute.
BENCH_SUITE ?= topologies
bench-topologies: install
	$(PY) -m benchmarks.topologies --suite $(BENCH_SUITE) --rounds 2 --json build/bench_$(BENCH_SUITE).json

# Bandwidth: the three modes on 2 and 3 emulated hosts (root: namespaces, tc) with links
# unshaped and at 1gbit, 100mbit and 10mbit against the same job over shared memory; SmolLM2, 3 rounds
# pooled; prints a table + JSON (about 7 minutes on 2 cores).
bench-network: install
	$(PY) -m benchmarks.network --rates none,1gbit,100mbit,10mbit --limit 2 --rounds 3 --json build/bench_network.json

# The scaling curve (BENCHMARKS.md, "Scaling on nodes with their own CPU"): Qwen2.5-Coder-1.5B on 1, 2, 4
# and 8 emulated hosts holding the machine's 2 cores fixed (2/N CPUs each, a cgroup quota; 1 thread
# per rank), iterative, speculative and pipeinfer with every draft, on the default and grounded
# prompts at 1 Gbit/s, iterative and pipeinfer at 100 Mbit/s, and the model on hosts too small for it.
# Every row runs CLUSTER_REPEAT times (median, min–max). Fails, naming the row, if any row's job fails
# or any text differs from iterative's. Needs root; the machine must be otherwise idle. CLUSTER_ARGS
# narrows it; each table goes to build/cluster_*.md as well as the terminal.
CLUSTER_HOSTS  ?= 1,2,4,8
CLUSTER_REPEAT ?= 3
CLUSTER_ARGS   ?= --limit 1 -n 32
CLUSTER        := $(PY) -m benchmarks.scaling --repeat $(CLUSTER_REPEAT)
bench-cluster: install
	@mkdir -p build
	$(VENV)/bin/pipeinfer models pull qwen2.5-coder-1.5b-instruct
	$(VENV)/bin/pipeinfer models pull qwen2.5-coder-0.5b-instruct qwen2.5-coder-0.5b-instruct-q4_0
	$(VENV)/bin/pipeinfer models pull smollm2-135m-instruct
	$(CLUSTER) --hosts $(CLUSTER_HOSTS) --rates 1gbit --prompts default $(CLUSTER_ARGS) --json build/cluster_default.json --markdown build/cluster_default.md
	$(CLUSTER) --hosts $(CLUSTER_HOSTS) --rates 1gbit --prompts grounded $(CLUSTER_ARGS) --json build/cluster_grounded.json --markdown build/cluster_grounded.md
	$(CLUSTER) --hosts $(CLUSTER_HOSTS) --rates 100mbit --prompts default --configs iterative,pipeinfer:smollm2-135m-instruct $(CLUSTER_ARGS) --json build/cluster_100mbit.json --markdown build/cluster_100mbit.md
	$(CLUSTER) --hosts 1,2,4 --configs iterative,pipeinfer:smollm2-135m-instruct --mem 800m $(CLUSTER_ARGS) --json build/cluster_mem.json --markdown build/cluster_mem.md
	$(PY) -m benchmarks.cluster_plot build/cluster_default.json build/cluster_grounded.json build/cluster_100mbit.json --out docs/cluster.png

# Standard comparison on the Qwen pair (pulled if needed), greedy: llama.cpp's own decoding at the
# same total threads first, then every mode interleaved over the shipped prompts on BENCH_RANKS
# ranks, then the section of BENCHMARKS.md between the bench markers (table, ratios, docs/bench.png).
# Modes that disagree on tokens make `pipeinfer bench` exit 1 after writing its JSON: BENCHMARKS.md
# still gets the figures, under a warning, and make fails.
BENCH_MODEL   ?= qwen-coder
BENCH_RANKS   ?= 2
BENCH_N       ?= 128
BENCH_THREADS ?= $(shell nproc)
BENCH_ARGS    ?= --modes iterative,speculative,pipeinfer --temp 0 --repeat 1 --warmup 1
BENCH_PROMPTS ?=# e.g. "--prompts my.jsonl --limit 2"; given to both runs, so they see the same prompts
# `make bench` = the modes on the default topology (above), then `iterative` against `pipeinfer` on
# every topology (benchmarks/topologies.py --suite topologies) with the default prompt set and the
# grounded one (answers that copy from the prompt). About 50 minutes on 2 cores.
TOPO_ARGS ?= --rounds 1 --limit 4
bench: bench-modes
	$(PY) -m benchmarks.topologies --suite topologies $(TOPO_ARGS) -n $(BENCH_N) --json build/bench_topologies_default.json --markdown build/bench_topologies_default.md
	$(PY) -m benchmarks.topologies --suite topologies $(TOPO_ARGS) -n $(GROUNDED_N) --prompts grounded --json build/bench_topologies_grounded.json --markdown build/bench_topologies_grounded.md

bench-modes: install
	@mkdir -p build docs
	$(PY) -m benchmarks.llamacpp $(BENCH_MODEL) -n $(BENCH_N) --threads $(BENCH_THREADS) $(BENCH_PROMPTS) --json build/bench_llamacpp.json
	@rm -f build/bench.json
	$(VENV)/bin/pipeinfer bench $(BENCH_MODEL) --ranks $(BENCH_RANKS) -n $(BENCH_N) $(BENCH_ARGS) $(BENCH_PROMPTS) \
	  --json build/bench.json --csv build/bench.csv --trace build/bench.trace.json --plot docs/bench.png; \
	status=$$?; \
	if [ -f build/bench.json ]; then \
	  $(PY) -m benchmarks.update_md build/bench.json --baseline build/bench_llamacpp.json --plot docs/bench.png --out BENCHMARKS.md; \
	fi; exit $$status

# Grounded prompt set (`--prompts grounded`: answers that copy from 400-550-token prompts), greedy,
# -n 96, end to end: llama.cpp plain and llama.cpp's own prompt-lookup decoding at BENCH_THREADS
# threads in one process, then pipeinfer on GROUNDED_RANKS ranks with --draft lookup and with the
# pair's 0.5B draft (iterative in the same job as the reference), then the side-by-side table
# (build/grounded.md; BENCHMARKS.md's "Grounded prompts" section quotes it). About 15 minutes on 2 cores.
GROUNDED_N     ?= 96
GROUNDED_RANKS ?= 2
GROUNDED_ARGS  ?= --temp 0 --repeat 1 --warmup 1
bench-grounded: install
	@mkdir -p build
	$(PY) -m benchmarks.llamacpp $(BENCH_MODEL) --prompts grounded -n $(GROUNDED_N) --threads $(BENCH_THREADS) --json build/grounded_llamacpp.json
	$(PY) -m benchmarks.llamacpp $(BENCH_MODEL) --prompts grounded -n $(GROUNDED_N) --threads $(BENCH_THREADS) --lookup --ctx 1024 --json build/grounded_llamacpp_lookup.json
	$(VENV)/bin/pipeinfer bench $(BENCH_MODEL) --draft lookup --prompts grounded --ranks $(GROUNDED_RANKS) -n $(GROUNDED_N) --modes iterative,pipeinfer $(GROUNDED_ARGS) --json build/grounded_lookup.json
	$(VENV)/bin/pipeinfer bench $(BENCH_MODEL) --prompts grounded --ranks $(GROUNDED_RANKS) -n $(GROUNDED_N) --modes iterative,pipeinfer $(GROUNDED_ARGS) --json build/grounded_pair.json
	$(PY) -m benchmarks.grounded_table --ref build/grounded_llamacpp.json --ref build/grounded_llamacpp_lookup.json \
	  --bench build/grounded_lookup.json --bench build/grounded_pair.json --markdown build/grounded.md

# Every message tag x every fault (drop, delay, dup, kill, stall) injected with PIPEINFER_DEBUG_FAULT
# in real SmolLM2 jobs on 3 ranks + a draft rank and with the draft on the head: each cell must end in
# the fault-free text or one error naming a rank within 10 s, no process left (prints the table).
fault-matrix: install
	@mkdir -p build
	$(PY) scripts/fault_matrix.py --json build/fault_matrix.json

# One 3-rank job serving 1,000 requests in a row (all modes, model and lookup drafts, trees, random
# lengths, seeded): KV cells, resident memory, fds, threads and a control prompt's tokens checked.
SOAK_REQUESTS ?= 1000
soak: install
	@mkdir -p build
	$(PY) scripts/soak.py --requests $(SOAK_REQUESTS) --json build/soak.json

# llama.cpp's RPC backend (docs/emulated-cluster.md, "llama.cpp's RPC backend on the same hosts"): the
# llama.cpp tree vendored by the pinned llama-cpp-python sdist (PyPI), built with GGML_RPC=ON and the CPU
# features /proc/cpuinfo reports (never AMX), statically linked, into build/llama-rpc/. Needs no venv;
# a second run does nothing. About 6 minutes on 2 cores.
LLAMA_RPC_DIR ?= build/llama-rpc
llama-rpc: $(LLAMA_RPC_DIR)/.stamp

$(LLAMA_RPC_DIR)/.stamp: scripts/build_llama_rpc.sh pyproject.toml
	scripts/build_llama_rpc.sh $(LLAMA_RPC_DIR)

# llama.cpp over RPC (one rpc-server per host 1..N-1, the client on host 0) against pipeinfer iterative on
# the same hosts, same prompts, greedy; the emulated cluster must be up (scripts/emulate-cluster.sh up N).
BENCH_RPC_ARGS ?= --limit 2 -n 32 --pipeinfer
bench-rpc: install llama-rpc
	@mkdir -p build
	$(PY) -m benchmarks.rpc $(BENCH_RPC_ARGS) --json build/bench_rpc.json

# serve losing a node (docs/server.md, "Surviving a lost node"): 4 emulated hosts x 0.5 CPU, the Qwen pair,
# a rank SIGKILLed and a host's link taken down, --parallel 2 and 1; fails if any answer differs.
bench-serve-recovery: install
	@mkdir -p build
	$(VENV)/bin/pipeinfer models pull qwen-coder
	$(PY) -m benchmarks.serve_recovery --hosts 4 --cpus 0.5 --json build/serve_recovery.json --markdown build/serve_recovery.md
