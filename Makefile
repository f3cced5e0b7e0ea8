# The two commands a new user needs:  `make demo` (install, then run the main job here)
# and `make test` (install what the tests need, start their services, run them).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# pytest-xdist workers for `make test`: each test module whole on one worker, the test Slurm's modules
# on one (tests/conftest.py); 2 keeps CI's two cores busy while one test waits on Slurm or a timeout
TEST_WORKERS ?= 2

.PHONY: install demo test lint bench clean

$(VENV)/.installed: pyproject.toml
	@echo "==> 1/4 creating $(VENV)"
	python3 -m venv $(VENV)
	@echo "==> 2/4 upgrading pip"
	$(PIP) install -q --upgrade pip
	@echo "==> 3/4 torch, CPU build (a download of a few hundred MB; the progress bar follows)"
	# torch pinned to the CPU build (a bare range would pull a multi-GB CUDA build)
	$(PIP) install --progress-bar on "torch==2.13.0" numpy
	@echo "==> 4/4 launch4d and its test tools"
	$(PIP) install -q -e '.[train,test]'
	touch $@
	@echo "==> installed: $(VENV)/bin/launch"

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/launch plan examples/llama3-70b-64xh100.yaml --top 3
	$(VENV)/bin/launch run examples/tiny-cpu.yaml

# ruff over every Python folder, mypy over the files pyproject's [tool.mypy] names
lint: install
	$(VENV)/bin/ruff check launcher checks tests benchmarks
	$(VENV)/bin/mypy

test: lint
	bash .ci/setup-services.sh
	$(PY) -m pytest -q -rs -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile

bench: install
	for b in benchmarks/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info
