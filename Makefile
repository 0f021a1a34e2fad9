# Every target runs from the repository root. PYTHON defaults to python3: the active virtual
# environment's (the README's set-up; in CI, the one .ci/run activates), else the system's.
PYTHON ?= python3
TRACK ?= hopper
PYTEST = $(PYTHON) -m pytest
# Tests run on every core (pytest-xdist); JOBS=1 runs them in one process.
JOBS ?= auto

.PHONY: help setup lint format test tour bench model test-gpu notebooks notebooks-source sanitize clocks doctor stage-1 stage-2 stage-3 stage-4 stage-5 stage-6 stage-7 stage-8 stage-9 stage-10 stage-11 stage-12 stage-13 stage-14 stage-15 diff-1 diff-2 diff-3 diff-4 diff-5 diff-6 diff-7 diff-8 diff-9 diff-10 diff-11 diff-12 diff-13 diff-14 diff-15 diff-sizes host-time cp

help:
	@echo "make setup      install what is missing: torch (CPU build without a GPU), requirements.txt, the DSL libs for torch's CUDA"
	@echo "make tour       every stage on this machine's track: compile, instructions, correctness, TFLOP/s"
	@echo "make lint       ruff format --check and ruff check (what CI runs; make format rewrites)"
	@echo "make test       all tests (GPU tests skip with a reason when the GPU is absent)"
	@echo "make test-gpu   only the tests that launch kernels (what a GPU adds to CI's compile-only run)"
	@echo "make stage-N    the tests of stage N (1..15); for N = 8..14 also stage 7's set run on stage N and its bit-for-bit check"
	@echo "make diff-N     what stage N changes over stage N-1 (N = 2..14; TRACK=hopper|blackwell)"
	@echo "make diff-sizes lines added + removed (docstring lines) of every diff-N, both tracks"
	@echo "make bench      benchmarks against cuBLAS / torch SDPA / FA4, timed in the same run"
	@echo "make host-time  host work per call of the entry points at a tiny shape (GPU)"
	@echo "make cp GPUS=N  stage 15: ring attention over N GPUs (torchrun; CP_ARGS=--cpu runs it on CPU processes at S = 1024)"
	@echo "make model      a Llama-style transformers model on each stage's kernel from 7 on: logits vs SDPA, prefill tokens/s vs SDPA and FA4; a decode run on stage 14's paged KV cache (needs transformers)"
	@echo "make notebooks  execute every notebook (compile-only mode without a GPU)"
	@echo "make notebooks-source  rewrite notebooks/*.ipynb from notebooks/source/ (their single source)"
	@echo "make sanitize   compute-sanitizer racecheck + synccheck on stages 4-14 (GPU)"
	@echo "make clocks     stage 12, FA4 and cuDNN run back to back at the power cap: SM clock, power and work per cycle (GPU)"
	@echo "make doctor     versions, GPU, driver, arch"

setup:
	@$(PYTHON) -m common.tools.setup

lint: setup
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m ruff check .

format: setup
	$(PYTHON) -m ruff format .
	$(PYTHON) -m ruff check --fix .

test: setup
	$(PYTEST) -q -n $(JOBS) $(PYTEST_ARGS)

test-gpu: setup
	$(PYTEST) -q -n $(JOBS) -m "gpu_hopper or gpu_blackwell or gpu_any" $(PYTEST_ARGS)

tour: setup
	$(PYTHON) -m common.tools.tour

bench: setup
	$(PYTHON) -m common.tools.bench

# Needs transformers (optional: pip install 'transformers>=4.48'); without it, or without an
# sm_90 GPU, it prints why and exits 0. MODEL_ARGS: e.g. --layers 2 --shapes 2x2048.
model: setup
	$(PYTHON) -m common.tools.model $(MODEL_ARGS)

GPUS ?= 2
cp: setup
	$(PYTHON) -m torch.distributed.run --standalone --nproc-per-node $(GPUS) -m common.tools.cp_run $(CP_ARGS)

diff-sizes:
	$(PYTHON) -m common.tools.diff_sizes

host-time: setup
	$(PYTHON) -m common.tools.host_time

notebooks: setup
	$(PYTHON) -m common.tools.nbrun $$(ls notebooks/*.ipynb | sort -V)

notebooks-source:
	$(PYTHON) notebooks/source/gen.py

sanitize: setup
	$(PYTHON) -m common.tools.sanitize

clocks: setup
	$(PYTHON) -m common.tools.clock_probe

doctor:
	@$(PYTHON) -m common.tools.doctor

# Stage 7's test set runs on every stage from 7 on (tests/tracks.py, KERNEL_STAGES) and
# tests/test_stage_chain.py checks stages 8-14 against the stage before, bit for bit: stage-N
# takes its own share of both (test ids name the stage: hopper-stage8-..., [8-...]).
LATER_STAGES = 8 9 10 11 12 13 14
$(addprefix stage-,1 2 3 4 5 6 15): stage-%: setup
	$(PYTEST) -q $(wildcard tests/test_stage$*.py tests/test_stage$*_*.py)

stage-7: setup
	$(PYTEST) -q $(wildcard tests/test_stage7.py tests/test_stage7_*.py) \
	  -k "not ($(subst $(eval) , or ,$(addprefix stage,$(LATER_STAGES))))"

$(addprefix stage-,$(LATER_STAGES)): stage-%: setup
	$(PYTEST) -q $(wildcard tests/test_stage$*.py tests/test_stage$*_*.py) tests/test_stage7.py \
	  tests/test_stage_chain.py -k "stage$* or (stage_chain and ([$*-$(if $(filter 12,$*), or each_tuning_alone)))"

diff-1 diff-15:
	@echo "make diff-N takes N = 2..14: stage 1 is the first, and stage 15 adds no kernel (its ring runs stage 14's)"

$(addprefix diff-,2 3 4 5 6 7 8 9 10 11 12 13 14): diff-%:
	@n=$*; p=$$((n-1)); \
	b=$$(ls -d stages/stage$${n}_*); \
	if [ ! -f $$b/$(TRACK).py ]; then echo "stage $$n has no $(TRACK) kernel yet ($$b/$(TRACK).py)"; exit 0; fi; \
	while [ $$p -gt 1 ] && [ ! -f $$(ls -d stages/stage$${p}_*)/$(TRACK).py ]; do \
	  echo "stage $$p has no $(TRACK) kernel: the diff is against stage $$((p-1))"; p=$$((p-1)); done; \
	a=$$(ls -d stages/stage$${p}_*); \
	git --no-pager diff --no-index --stat $$a/$(TRACK).py $$b/$(TRACK).py; \
	git --no-pager diff --no-index $$a/$(TRACK).py $$b/$(TRACK).py; true
