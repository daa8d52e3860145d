# `make demo` and `make test` set up .venv on first use (quick no-op afterwards), then run.
# A demo run replaces the previous one in its output_dir (overwrite=true; ARGS=overwrite=false keeps the
# check that refuses a new run in a folder holding another run, ARGS=resume=auto continues the last run).
DEMO := overwrite=true
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.forge_rl-setup-done
EXTRAS_STAMP := $(VENV)/.forge_rl-extras-done

.PHONY: setup setup-extras setup-slurm demo demo-ppo demo-rm demo-multiturn demo-reasoning-gym demo-openenv demo-agent demo-verifiers demo-distill demo-lora demo-moe demo-vlm demo-tinker test test-fast lint format gpu-check wheelhouse clean
setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup_env.sh scripts/install.py
	bash scripts/setup_env.sh $(VENV)
	touch $(STAMP)

# The optional integrations (pyproject.toml: envs, agents, tinker) the tests exercise against the real packages;
# `make demo` does not need them.
setup-extras: $(EXTRAS_STAMP)

$(EXTRAS_STAMP): $(STAMP) scripts/tinker-cookbook.txt
	$(PY) scripts/install.py -e ".[envs,agents,tinker]"
	$(PY) scripts/install.py --no-deps -r scripts/tinker-cookbook.txt
	$(PY) -c 'import reasoning_gym, openenv, verifiers, openai, vllm, tinker, tinker_cookbook.rl.train'
	touch $(EXTRAS_STAMP)

demo: setup
	$(PY) -m apps.grpo.main --config configs/grpo/tiny.yaml $(DEMO) $(ARGS)

demo-ppo: setup  # PPO with a critic, one sample per prompt (configs/ppo/tiny.yaml)
	$(PY) -m apps.ppo.main --config configs/ppo/tiny.yaml $(DEMO) $(ARGS)

demo-rm: setup  # GRPO scored only by a learned reward model, tiny-rm, never the answer (configs/grpo/tiny_rm.yaml)
	$(PY) -m apps.grpo.main --config configs/grpo/tiny_rm.yaml $(DEMO) $(ARGS)

demo-multiturn: setup  # addition with a retry after feedback: a multi-turn environment (configs/grpo/tiny_retry.yaml)
	$(PY) -m apps.grpo.main --config configs/grpo/tiny_retry.yaml $(DEMO) $(ARGS)

demo-reasoning-gym: setup-extras  # a reasoning-gym task (basic_arithmetic, + only, 2 digits), its scorer as the reward (configs/grpo/tiny_reasoning_gym.yaml)
	$(PY) -m apps.grpo.main --config configs/grpo/tiny_reasoning_gym.yaml $(DEMO) $(ARGS)

demo-openenv: setup-extras  # an OpenEnv environment (examples/openenv_addition: addition with a retry) trained through its HTTP server (configs/grpo/tiny_openenv.yaml)
	$(PY) -m apps.grpo.main --config configs/grpo/tiny_openenv.yaml $(DEMO) $(ARGS)

demo-agent: setup-extras  # an agent written only against the openai client (examples/agents/retry_agent.py) trained through the run's OpenAI-compatible endpoint (configs/grpo/tiny_agent.yaml)
	$(PY) -m apps.grpo.main --config configs/grpo/tiny_agent.yaml $(DEMO) $(ARGS)

demo-verifiers: setup-extras  # a verifiers environment (examples/verifiers_addition) trained through the run's OpenAI-compatible endpoint (configs/grpo/tiny_verifiers.yaml)
	$(PY) -m apps.grpo.main --config configs/grpo/tiny_verifiers.yaml $(DEMO) $(ARGS)

demo-distill: setup  # on-policy distillation of tiny-warm from tiny-teacher (configs/distill/tiny.yaml)
	$(PY) -m apps.distill.main --config configs/distill/tiny.yaml $(DEMO) $(ARGS)

demo-lora: setup  # GRPO training LoRA adapters, adapter-only weight sync (configs/grpo/tiny_lora.yaml)
	$(PY) -m apps.grpo.main --config configs/grpo/tiny_lora.yaml $(DEMO) $(ARGS)

demo-moe: setup  # GRPO on a mixture-of-experts model, tiny-moe (Qwen3-MoE in TorchTitan and vLLM; configs/grpo/tiny_moe.yaml)
	$(PY) -m apps.grpo.main --config configs/grpo/tiny_moe.yaml $(DEMO) $(ARGS)

demo-vlm: setup  # GRPO on the embedded tiny vision-language model, tiny-vlm (Idefics3): two digits drawn into an image, the answer the two digits read (configs/grpo/tiny_vlm.yaml; docs/vision.md)
	$(PY) -m apps.grpo.main --config configs/grpo/tiny_vlm.yaml $(DEMO) $(ARGS)

demo-tinker: setup-extras  # RL on addition with tinker-cookbook's own RL loop (examples/tinker/cookbook_rl_addition.py; LOOP=client: rl_addition.py, written only against the tinker client), served by forge_rl's Tinker service on tiny-warm (configs/tinker/demo.yaml; docs/tinker.md)
	PY=$(PY) bash examples/tinker/demo.sh $(ARGS)

# make test runs two test modules at a time (pytest-xdist), each module whole on one worker (--dist loadfile) so that
# the actors a module shares start once. One launch of a run leaves part of a 2-core machine idle while its procs
# start and wait; two keep it busy (peak memory of the suite: about 8 GB). The modules start longest first, in the
# order tests/conftest.py gives them (xdist's own reorder, by number of tests, would leave the long single-test
# modules for last). TEST_WORKERS=0 runs in this process (what --pdb needs).
TEST_WORKERS ?= 2
test: setup-extras lint
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(ARGS)

test-fast: setup-extras lint  # unit tests only (no procs, engines or ranks): what to run while developing (CONTRIBUTING.md)
	$(PY) -m pytest -n $(TEST_WORKERS) tests/unit $(ARGS)  # the folder, not the marker: integration modules are not even imported

lint: setup  # the formatter's check and the linter (ruff, configured in pyproject.toml); `make format` fixes the first
	$(PY) -m ruff format --check --quiet . || { echo "make lint: run 'make format' to format the files above"; exit 1; }
	$(PY) -m ruff check --quiet .

format: setup
	$(PY) -m ruff format --quiet .

gpu-check: setup  # the GPU path in one command (<= 10 min on one H100): says which tiers run here and why not the others, runs them; on CPU: its logic checks
	$(PY) -m gpu_check $(ARGS)

# For a GPU host with a site PyTorch and no network (docs/getting_started.md); needs pip and `packaging`, not the venv.
PYTHON_VERSION ?= 3.12
wheelhouse:  # the no-vLLM tier's wheels for PYTHON_VERSION, manylinux x86_64, without torch or vLLM (ARGS="--with-vllm --glibc 2.35" adds it), in parts of <= 60 MB under wheelhouse/
	python3 scripts/wheelhouse.py --python $(PYTHON_VERSION) $(ARGS)

setup-slurm:  # Debian's Slurm and munge, for tests/integration/test_slurm.py (a real cluster in network namespaces; root)
	apt-get install -y -q slurm-wlm munge || (apt-get update -q && apt-get install -y -q slurm-wlm munge)

clean:
	rm -rf $(VENV)
