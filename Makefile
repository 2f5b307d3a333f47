# The README's two commands: `make demo` (the main job) and `make test` (the test suite).
# Both install what they need first (scripts/install.sh is idempotent and quick when done).
PY ?= python3
export TIDE_HOME ?= $(HOME)/.cache/tide

.PHONY: install demo test test-unit static-drafter bench

install:
	bash scripts/install.sh

demo: install
	$(PY) -m tide.cli demo

test: install
	$(PY) -m ruff check tide tests bench scripts
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=25 tests

test-unit: install
	$(PY) -m pytest -q tests/unit

# Reproduces the packaged static drafter (tide/assets/drafters/smollm2-static) from scratch.
static-drafter: install
	$(PY) -m tide.cli train --static --out tide/assets/drafters/smollm2-static

bench: install
	$(PY) -m bench.spec_decode --json reports/bench/spec_decode.json
