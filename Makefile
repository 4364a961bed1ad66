# The two commands of the README: `make run` and `make test`. Each creates the virtual
# environment and installs what it needs on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: console-screenshots run test test-deploy wheels image lint bench-core bench-peers bench-minilm bench-hotswap bench-grpc examples model grpc-stubs clean

$(BIN)/python:
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "inferq needs Python 3.11 or newer"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.run: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.dev: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'
	touch $@ $(VENV)/.run

$(VENV)/.deploy: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev,deploy]'
	touch $@ $(VENV)/.dev $(VENV)/.run

$(VENV)/.bench: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev,bench]'
	touch $@ $(VENV)/.dev $(VENV)/.run

## run: start Redis (if none answers), the gateway and a worker serving the example model
run: $(VENV)/.run
	@echo "make run: the inferq command is in $(VENV): '. $(VENV)/bin/activate' puts it on the PATH"
	$(BIN)/inferq up $(ARGS)

## test: lint, then the whole test suite (it starts its own redis-server): the tests not marked
## serial on TEST_JOBS pytest processes at once, then the serial ones alone (scripts/run-tests)
TEST_JOBS ?= 3
test: $(VENV)/.dev
	./scripts/ensure-redis
	./scripts/ensure-promtool
	./scripts/ensure-chromium
	$(BIN)/ruff check .
	PYTEST=$(BIN)/pytest TEST_JOBS=$(TEST_JOBS) ./scripts/run-tests $(ARGS)

## console-screenshots: docs/console/*.png, the README's console pictures, taken by the console's
## browser tests against a live `inferq up --workers 2`
console-screenshots: $(VENV)/.dev
	./scripts/ensure-redis
	./scripts/ensure-chromium
	INFERQ_CONSOLE_SCREENSHOTS=$(CURDIR)/docs/console $(BIN)/pytest -q tests/integration/test_console_browser.py

## wheels: build/wheels, inferq and its dependencies for the image (ops/Dockerfile installs them offline)
wheels:
	scripts/wheelhouse

## image: podman (installed if missing), a Debian base image and the stand-ins made without a
## registry, then the inferq image (scripts/images)
image:
	scripts/ensure-podman
	scripts/images

## test-deploy: the Compose stack for real under podman: up, the README's requests, Prometheus,
## a killed worker, draining, down (tests/ops/test_compose.py)
test-deploy: image $(VENV)/.deploy
	INFERQ_DEPLOY_TEST=1 $(BIN)/pytest tests/ops/test_compose.py -rP $(ARGS)

lint: $(VENV)/.dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy protocol runtime producer consumer inferq

## bench-core: the issue #2 benchmark (digits through inferq up vs in-process)
bench-core: $(VENV)/.dev
	$(BIN)/python bench/core.py $(ARGS)

## bench-peers: inferq vs plain FastAPI and an in-process asyncio batcher, side by side (issue #14);
## REAL=1 then runs the real peers too (Triton, MLServer, BentoML, LitServe, KServe, Ray Serve:
## bench/realpeers/run.py, each in its own venv under /work/peers, built on first use; REAL_ARGS
## are its options). Neither is in the dev extra or in CI.
bench-peers: $(VENV)/.bench
	./scripts/ensure-redis
	./scripts/ensure-wrk
	$(BIN)/python bench/peers.py $(ARGS)
ifneq ($(REAL),)
	$(BIN)/python bench/realpeers/run.py $(REAL_ARGS)
endif

## bench-minilm: minilm sentence embeddings through inferq up vs the same ONNX session in-process
bench-minilm: $(VENV)/.dev
	$(BIN)/python bench/minilm.py $(ARGS)

## bench-hotswap: a hot swap of minilm under load, timeline and P99 before/during/after
bench-hotswap: $(VENV)/.dev
	$(BIN)/python bench/hotswap.py $(ARGS)

## bench-grpc: gRPC vs HTTP JSON vs HTTP binary tensors, c=1 and c=64
bench-grpc: $(VENV)/.dev
	$(BIN)/python bench/grpc_vs_http.py $(ARGS)

## examples: build the example models that are not in git (minilm, digits-pt) into models/
examples: $(VENV)/.dev
	$(BIN)/inferq models build-examples

## grpc-stubs: regenerate protocol/grpc/inferq_v2_pb2.py(.pyi) from protocol/grpc/inference.proto
grpc-stubs: $(VENV)/.dev
	PYTHON=$(BIN)/python scripts/grpc-stubs

## model: retrain and re-export the digits example model
model: $(VENV)/.dev
	$(BIN)/python models/digits/train.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache bench/results
