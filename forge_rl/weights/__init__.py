"""Versioned model weights from trainer ranks to generator replicas (see docs/weight_store.md).

    store = ShmWeightStore(run_id, WeightStoreConfig(keep_versions=2))
    store.publish(5, hf_state_dict)                 # one writer, full tensors
    with store.writer(5, spec, rank, world) as w:    # or: every rank writes its (DTensor) shards
        for name, t in shards.items(): w.write(name, t)
    await store.prefetch(5)                          # reader: this host now holds v5
    with store.pinned(5) as path:                    # writers leave v5's pages alone meanwhile
        engine.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
    views = store.load(5)                            # or: read-only views, pinned while they live

The names below are imported on first use, so that store_config.py (WeightStoreConfig) is read without torch.
"""

import importlib

_HOMES = {
    "ShmVersionWriter": "forge_rl.weights.shm",
    "ShmWeightStore": "forge_rl.weights.shm",
    "TensorSpec": "forge_rl.weights.store",
    "VersionUnavailable": "forge_rl.weights.store",
    "VersionWriter": "forge_rl.weights.store",
    "WeightMismatch": "forge_rl.weights.store",
    "WeightStore": "forge_rl.weights.store",
    "WeightStoreConfig": "forge_rl.weights.store_config",
    "WeightStoreFull": "forge_rl.weights.store",
    "check_spec": "forge_rl.weights.store",
    "cleanup_stale_runs": "forge_rl.weights.runs",
    "register_process": "forge_rl.weights.runs",
    "remove_run": "forge_rl.weights.runs",
    "spec_of": "forge_rl.weights.store",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
