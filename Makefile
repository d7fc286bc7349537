# Everyday commands. Each target is one command you can also type yourself; `make` lists them.
PYTHON ?= python

.PHONY: help install train test test-fast lint format rename

help:  ## list the targets
	@grep -E "^[a-z-]+:.*## " $(MAKEFILE_LIST) | sed -E "s/:.*## /\t/"

install:  ## editable install with the test and lint tools, at the versions in constraints.txt
	$(PYTHON) -m pip install -c constraints.txt -e "./engine[dev]" -e ".[dev]"

train:  ## train with the default config; overrides in ARGS, e.g. make train ARGS="trainer.devices=4"
	$(PYTHON) train.py $(ARGS)

test:  ## the whole suite, as the README and CI run it
	pytest

test-fast:  ## the fast half (no multi-process or end-to-end runs), under a minute
	pytest -m "not slow"

lint:  ## what CI checks: lint and formatting
	ruff check . && ruff format --check .

format:  ## fix what can be fixed, then format
	ruff check --fix . && ruff format .

rename:  ## rename the project, e.g. make rename NAME=<new_name>
	@test -n "$(NAME)" || { echo "usage: make rename NAME=<new_name>" >&2; exit 2; }
	$(PYTHON) scripts/rename.py $(NAME)
