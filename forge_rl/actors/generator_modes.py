"""The generator's choices a run's config names, apart from the generator actor so that a config is read
without torch or vLLM."""

# How a live weight update treats in-flight requests (forge_rl/actors/generator.py, update_weights).
SWAP_MODES = ("keep_kv", "recompute_kv", "drain")
