# The two commands a newcomer types on a fresh machine: `make demo`, `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench horovod clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py --mesh_shape='data:2;model:2' \
	    --layout='batch:data;d_ff:model;vocab:model'

test: $(STAMP)
	bash scripts/install_horovod.sh $(PY)  # the Horovod tests run in CI too
	TF_CPP_MIN_LOG_LEVEL=3 $(PY) -m pytest -q -p no:cacheprovider -n 2

bench: $(STAMP)
	$(PY) bench/mesh_strategy.py
	$(PY) bench/moe.py
	$(PY) bench/xc_softmax.py
	$(PY) bench/xc_processes.py

# Horovod 0.28.1 built against the installed TF (about 10 minutes; wheel cached).
horovod: $(STAMP)
	bash scripts/install_horovod.sh $(PY)

clean:
	rm -rf $(VENV) build *.egg-info
