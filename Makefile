# attncert: `make pipeline` runs the study, `make test` runs the tests. Both create the
# environment (.venv, from the pins in requirements.txt) first when it is missing or stale.
#
#   make pipeline              dvc repro with params.yaml as it is (committed: paper scale)
#   make pipeline SCALE=cpu    apply profiles/cpu.yaml first (2 CPU cores, offline data; 36 min
#                              with WORKERS=2 below, 2026-11-29; 60 min on 2026-12-01's
#                              machine, about 2.1x slower: docs/scales.md)
#   make pipeline SCALE=smoke  apply profiles/smoke.yaml first (tiny, minutes)
#   make pipeline SCALE=paper  restore the committed paper-scale params first
#
# A profile never discards edits: params.yaml becomes git HEAD + the profile + your edits
# (values that differ from what the profile in force gives), so `make pipeline SCALE=cpu`
# after editing a value keeps it (`dvc params diff` shows it). Changing the scale refuses,
# naming the keys, when an edited key is one that the old or the new profile sets;
# KEEP_EDITS=1 carries such edits over as they are.
#   make pipeline GPUS="0 1"   spread the independent stages over these GPUs (scripts/repro-gpus)
#   make pipeline WORKERS=2    ... over 2 workers sharing the CPU (scripts/repro-gpus --cpu 2;
#                              the cpu scale's command: docs/scales.md)

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
FIX_TORCHVISION ?= ../shared/tools/fix-torchvision-cpu
SCALE ?=
KEEP_EDITS ?=
DVC ?= dvc
GPUS ?=
WORKERS ?=
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: env lock pipeline test lint bench rehearse pilot gpu-check gpu-bench gpu-wheels clean-env

env: $(VENV)/.installed

$(VENV)/.installed: requirements.txt constraints.txt requirements-nodeps.txt pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), "Python 3.11 is required, found " + sys.version.split()[0]'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -r requirements-nodeps.txt
	$(PY) -m pip install -q --no-deps -e .
	@# PyPI's torchvision 0.28 is a CUDA build; next to a CPU-only torch it needs stubs.
	@$(PY) -c 'import torchvision' 2>/dev/null || { \
	  if [ -x "$(FIX_TORCHVISION)" ]; then "$(FIX_TORCHVISION)" $(PY); \
	  else echo "torchvision does not import and $(FIX_TORCHVISION) is missing:" \
	    "install torch and torchvision builds that match (see README)" >&2; exit 1; fi; }
	$(PY) -c 'import torch, torchvision, attncert; print("torch", torch.__version__, "torchvision", torchvision.__version__)'
	touch $@

# after a change of requirements.txt, once the tests pass: the versions its pins pulled in, into
# constraints.txt (scripts/lock-constraints), so every fresh install resolves the same ones
lock: env
	$(PY) scripts/lock-constraints

pipeline: env
	$(if $(SCALE),$(PY) -m attncert.pipeline.profile apply $(SCALE) $(if $(KEEP_EDITS),--keep-edits))
	$(if $(GPUS),scripts/repro-gpus $(GPUS),$(if $(WORKERS),scripts/repro-gpus --cpu $(WORKERS),$(DVC) repro))

# two workers; a test file stays on one worker (the dvc tests share their smoke checkout); files
# in collection order, the longest first (tests/conftest.py), not xdist's order by test count
test: env
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder

lint: env
	$(PY) -m ruff check src tests notebooks

bench: env
	$(PY) -m attncert.bounds.bench
	$(PY) -m attncert.cost bench

# every big model of the paper scale built at random on this host (CPU by default), each kind
# alone: seconds per step, peak host memory, the batch that fits (docs/rehearsal.md)
rehearse: env
	$(PY) -m attncert.pipeline.rehearse --out reports/rehearsal.json

# on the GPU box, before the long run: one real unit of each big kind for one epoch in a scratch
# clone (.pilot/), its time, memory and projected hours (reports/pilot.json; docs/gpus.md)
pilot: env
	$(PY) -m attncert.pipeline.pilot

# on a GPU box: the device-relevant tests, the paper-shaped dry run on cuda, and the measured
# training step of each model kind (reports/gpu_check.json: the cost model's per-kernel constant)
gpu-check: env
	$(PY) -m attncert.pipeline.doctor --device cuda --calibrate reports/gpu_check.json
	$(PY) -m pytest -q tests/test_device.py tests/test_doctor.py tests/test_precision.py \
	  tests/test_batching.py tests/test_checkpoint_rng.py tests/test_certify_clock.py \
	  tests/test_compiled.py tests/test_compiled_attacks.py
	ATTNCERT_DRYRUN_DEVICE=cuda $(PY) -m pytest -q tests/test_paper_dryrun.py

# on a GPU box (about 15 minutes on an H200, estimated): eager against CUDA graphs per model kind
# (SpecFormer's two under PGD training too), per kind's PGD audit step and per training margin, each
# kind merged as it finishes; then K = 1 and 4 units at once per kind; into the records the cost
# table and the plan read (docs/compile_bench.json, docs/concurrency_bench.json; docs/gpus.md)
gpu-bench: env
	$(PY) -m attncert.cost bench --device cuda --batch 128 --steps 10 --modes eager graphs \
	  --write-compile
	$(PY) -m attncert.cost bench --device cuda --batch 128 --steps 20 --modes graphs \
	  --concurrent 1 4 8 --kinds all --concurrent-only --write-concurrency

# here, before a short GPU lease on a box without a registry: the pure-Python dependencies its
# image may lack, as wheels for scripts/gpu-session (carry .wheels; docs/gpus.md)
gpu-wheels: env
	$(PY) -m pip download -q --no-deps -d .wheels $$(grep -hoE '^(ruamel\.yaml|auto_LiRPA)==[^ ]+' \
	  requirements.txt requirements-nodeps.txt)

clean-env:
	rm -rf $(VENV)
