# The two commands a fresh clone needs:  make serve   /   make test
# Both create .venv when missing and install the project into it (tests with the `dev` extra).
VENV ?= .venv
PYTHON ?= python3
ARGS ?=
PYTEST_ARGS ?=
# pytest processes (`make test TEST_WORKERS=0` runs in one): most integration tests wait on servers they started,
# so two share two cores well; a file's tests stay in one process (its module fixtures start once).
TEST_WORKERS ?= 2

.PHONY: serve test lint install install-dev protos bench docs clean ref-env

# The public modules that are type-checked (the shared base, the caches, the engine, the configs, the policies).
TYPED = mimo_epd/common shm_cache llm_backend/engine llm_backend/config.py llm_backend/tokenizer.py \
	llm_backend/kv/pools.py llm_backend/kv/request_kv.py llm_backend/kv/swa_radix_cache.py llm_backend/kv/events.py encoder_server/config.py encoder_server/errors.py \
	mimo_epd/router/policies.py mimo_epd/router/index.py llm_backend/pd llm_backend/server/kv_transfer.py llm_backend/parallel

$(VENV)/.installed: pyproject.toml scripts/setup_env.sh
	PYTHON=$(PYTHON) bash scripts/setup_env.sh $(VENV)
	touch $@

# torchcodec (a bench peer in the dev extra) loads the system FFmpeg libraries: installed when missing (root + apt);
# without them its benchmark entry reports the loader's error instead.
$(VENV)/.installed-dev: pyproject.toml scripts/setup_env.sh
	-@if ! ldconfig -p 2>/dev/null | grep -q 'libavdevice\.so\.' && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "setup: installing FFmpeg libraries for torchcodec"; \
	  (apt-get update -qq && { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libavdevice59 libavfilter8 \
	    libavformat59 libavcodec59 libavutil57 libswscale6 libswresample4 || \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq ffmpeg; }) >/dev/null 2>&1 || \
	    echo "notice: FFmpeg libraries did not install; bench video reports why torchcodec cannot run"; fi
	PYTHON=$(PYTHON) bash scripts/setup_env.sh $(VENV) dev
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

serve: $(VENV)/.installed
	$(VENV)/bin/mimo-epd serve $(ARGS)

# vLLM's CPU build in its own environment: the parity reference for MiMo's towers (tests/encoder/test_mimo_vision_parity.py
# skips, saying so, where it is absent). About 90 s and 3.5 GB once; a no-op afterwards.
ref-env:
	PYTHON=$(PYTHON) bash scripts/ref_env.sh

test: lint ref-env
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy $(TYPED)
	$(VENV)/bin/lint-imports --no-cache

# Regenerates the committed gRPC stubs (tests/cli/test_protos.py checks they are current).
protos: $(VENV)/.installed-dev
	$(VENV)/bin/python -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. \
		protos/mimo_epd/v1/*.proto

# Regenerates docs/cli.md from the CLI's parsers (tests/cli/test_docs_and_cli.py checks it is current).
docs: $(VENV)/.installed
	$(VENV)/bin/python scripts/gen_cli_docs.py

clean:
	rm -rf $(VENV) .ref-venv .pytest_cache build *.egg-info
