"""Stands in for vLLM while `make gpu-check` runs its no-vLLM tier (gpu_check/__main__.py puts this folder first
on PYTHONPATH, for every process the tier starts): an import of vLLM from that tier fails, naming the rule."""

raise ImportError(
    "the no-vLLM tier imported vllm, which it must not: it has to run on hosts where vLLM cannot "
    "(see the traceback for who imported it)"
)
