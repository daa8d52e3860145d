"""A Tinker-compatible service backed by forge_rl's roles: the `tinker` client's training and sampling calls run
on forge_rl's Trainer (TorchTitan) and Generator (vLLM) actors. docs/tinker.md says what is served."""
