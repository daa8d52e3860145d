"""What forge_rl uses of its dependencies beyond their public APIs, one module per dependency: monarch.py,
torchtitan.py, vllm.py, pytorch.py. Everything else imports these names from here, so a new release that moves or
renames one breaks in one place, and tests/unit/deps/test_deps.py says which (docs/stack.md lists them and why)."""
