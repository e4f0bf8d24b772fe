# dsadapt — see README.md. `make demo` is the main job, `make test` the test suite.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# torch 2.13.0: PyPI serves its CUDA build (several GB with its CUDA libraries; it runs on the CPU
# too). For the small CPU build name PyTorch's CPU index, the one variable dsadapt's own installs
# read as well: `make setup DSADAPT_TORCH_INDEX=https://download.pytorch.org/whl/cpu` (or export it).
TORCH   ?= torch==2.13.0
DSADAPT_TORCH_INDEX ?=
export DSADAPT_TORCH_INDEX
# The gate's reference version (patcher/rules/logits.py REFERENCE_TRANSFORMERS): with it in dsadapt's
# own environment the reference runs there instead of in an extra venv.
TRANSFORMERS ?= transformers==5.24.0
PYTEST_ARGS ?=

.PHONY: setup demo test test-long test-fast lint lock-envs check-env-locks build-all bench reports gpu-check gpu-perf calibrate-speed gpu-reports docs clean

setup: $(BIN)/.installed

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check --upgrade pip
	@echo "… installing $(TORCH) and $(TRANSFORMERS) (pip shows each download; about 2 min the first time)"
	$(BIN)/python -m pip install --disable-pip-version-check --progress-bar off \
	  $(if $(DSADAPT_TORCH_INDEX),--extra-index-url $(DSADAPT_TORCH_INDEX)) "$(TORCH)" "$(TRANSFORMERS)"
	@echo "… installing dsadapt and its extras"
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[models,test,triton,dev]'
	$(BIN)/python -m compileall -q patcher
	touch $@

## The main job: apply the vLLM stack, build and install the patched engine, and run the
## logit-equivalence gate on the built-in tiny DeepSeek-V3 model (CPU, float32).
demo: setup
	$(BIN)/dsadapt apply vllm@v0.32.0
	$(BIN)/dsadapt build vllm@v0.32.0 --variant cpu
	$(BIN)/dsadapt install vllm@v0.32.0 --variant cpu
	$(BIN)/dsadapt check vllm@v0.32.0 --model v3 --config-style transformers

## The test suite but its long tier: fast tests, network tests on release artifacts, and the slow
## ones that install and run vLLM on CPU -- one engine check of each kind (about 20 minutes on 2 cores).
test: setup
	$(BIN)/python -m pytest -m "not long" $(PYTEST_ARGS)

## The long tier (tests/conftest.py LONG: a minute or more each -- real shapes, TP 2, the speed gate,
## Triton, the other planted bugs and dtypes). CI (.ci/run) runs `make test` and then this.
test-long: setup
	$(BIN)/python -m pytest -m long $(PYTEST_ARGS)

## Lint, types and architecture (CI's first job): ruff (E,F,W,I,B,UP,SIM) over the project, mypy
## over patcher/, the import contracts in pyproject.toml [tool.importlinter] (engines never
## import the orchestration; the core has no CLI in it; library modules stay below the orchestration),
## the code's shape (tests/project/test_code_shape.py: parameters, command length, radon grade),
## and actionlint over the GitHub workflows (a binary wheel from PyPI, in the dev extra).
lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy patcher
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/project/test_code_shape.py
	$(BIN)/actionlint .github/workflows/*.yml

## Hash locks of every environment of upstream.lock's pins, by `uv pip compile --generate-hashes
## --no-build` from the recipes in patcher/artifacts/envlocks.py (docs/environments.md), each written
## where it lives (the project's env-locks/ when it has one there, else the ones dsadapt ships in
## patcher/data/envs/) and checked as check-env-locks does. Needs PyPI and a source of the CPU torch
## build: DSADAPT_TORCH_INDEX (default PyTorch's CPU index) or the wheel folders in
## DSADAPT_LOCK_FIND_LINKS; without one it stops in one line. One new pin's locks, from PyPI alone:
## `dsadapt lock ENGINE@TAG`.
lock-envs: setup
	$(BIN)/python -m patcher.artifacts.envlocks

## Every environment has a lock, and every locked package has a PyPI wheel for the Python and
## platform its lock declares (asks PyPI; exit 6 when it cannot; `--offline`: the format only).
check-env-locks: setup
	$(BIN)/python -m patcher.artifacts.envlocks --check

## Fast feedback: no network, no engines.
test-fast: setup
	$(BIN)/python -m pytest -m "not slow and not network and not engine" $(PYTEST_ARGS)

build-all: setup
	$(BIN)/dsadapt build-all

bench: setup
	$(BIN)/python -m compileall -q patcher
	$(BIN)/dsadapt bench

## Regenerate the committed reports this machine can make: reports/plan.txt's cpu lines (vLLM 0.32 on
## CPU: every built-in model in every dtype, the V3 at TP 2, the speed gate at its documented size,
## the control; Triton r26.01 with a mirror of vllm_backend in DSADAPT_MIRRORS), each published into
## reports/ by `dsadapt ... --publish`. About 2 hours on 2 cores: run it when the machine is quiet (every
## command's load average is in the summary). Killed, it resumes when run again (--fresh: from the
## start). REPORTS_ARGS: e.g. --only vllm@v0.32.0, --dry-run (each command's time when last run),
## --lock FILE (hold FILE's flock while each command runs).
REPORTS_ARGS ?=
reports: setup
	$(BIN)/python tools/refresh_reports.py $(REPORTS_ARGS)

## The H200's committed reports (reports/plan.txt's h200 lines: LMDeploy 0.18 in bfloat16 and
## float16, the block-FP8 V3 slice): the offline bundle in .carry/reports and the device command.
REPORTS_BUNDLE ?= .carry/reports
gpu-reports: setup
	DSADAPT=$(BIN)/dsadapt bash tools/device/reports_h200.sh prepare $(REPORTS_BUNDLE)
	@echo "on the GPU machine, from this checkout: run command 'bash tools/device/reports_h200.sh device $(REPORTS_BUNDLE)'," \
	  "carry ['$(REPORTS_BUNDLE)'], timeout_s 480 (with the FP8 slice: about 6 minutes); or" \
	  "'DEADLINE=270 bash tools/device/reports_h200.sh device $(REPORTS_BUNDLE)', timeout_s 300 (the built-in models" \
	  "only: about 4 minutes); knobs: the script's header"
	@echo "then, here: bash tools/device/reports_h200.sh unpack OUT && $(BIN)/dsadapt report"

## The LMDeploy gate on a GPU machine without network (an H200 without network): the offline
## bundle in .carry/gpu (dsadapt bundle: builds, carried wheels, locks; what the H200 has is left
## out, tools/device/h200-pip-list.json) and the device command (tools/device/lmdeploy_h200.sh).
GPU_BUNDLE ?= .carry/gpu
gpu-check: setup
	DSADAPT=$(BIN)/dsadapt bash tools/device/prepare_bundle.sh $(GPU_BUNDLE)
	@echo "on the GPU machine, from this checkout: run command 'bash tools/device/lmdeploy_h200.sh $(GPU_BUNDLE)'," \
	  "carry ['$(GPU_BUNDLE)'], timeout_s 600 (the chains: tools/device/calibration.chains; knobs: the script's header)"
	@echo "then, here: mkdir -p back && tar xzf OUT/reports.tgz -C back && python tools/calibrate_low_precision.py table back"

## The speed gate's calibration on the GPU machine: an offline bundle of the LMDeploy stack with the
## planted decode work (tools/plant_decode_work.py) in .carry/perf, and the device command
## (tools/device/perf_h200.sh device: A/A and planted runs in parallel chains, docs/speed.md).
gpu-perf: setup
	DSADAPT="$(BIN)/dsadapt" PYTHON="$(BIN)/python" bash tools/device/perf_h200.sh prepare
	@echo "then, here: tar xzf OUT/reports.tgz -C .carry/perf && $(BIN)/python tools/speed_calibration.py .carry/perf/perf-calibration/reports"

## The speed gate's calibration on this machine (CPU): RUNS A/A and planted runs (tools/calibrate_speed.sh;
## run it when the machine is quiet: every report records the load average).
calibrate-speed: setup
	PYTHON="$(BIN)/python" bash tools/calibrate_speed.sh

## Regenerate docs/commands.md from the commands' help.
docs: setup
	$(BIN)/python -c "from patcher.cli.main import cli; from patcher.cli.commands.reference import command_reference; \
	text = command_reference(cli); open('docs/commands.md', 'w').write(text)"

clean:
	rm -rf dist .pytest_cache
