"""Versioned model weights from trainer ranks to generator replicas (see docs/weight_store.md).

    store = ShmWeightStore(run_id, WeightStoreConfig(keep_versions=2))
    store.publish(5, hf_state_dict)                 # one writer, full tensors
    with store.writer(5, spec, rank, world) as w:    # or: every rank writes its (DTensor) shards
        for name, t in shards.items(): w.write(name, t)
    await store.prefetch(5)                          # reader: this host now holds v5
    with store.pinned(5) as path:                    # writers leave v5's pages alone meanwhile
        engine.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
    views = store.load(5)                            # or: read-only views, pinned while they live
"""

from forge_rl.weights.runs import cleanup_stale_runs, register_process, remove_run
from forge_rl.weights.shm import ShmVersionWriter, ShmWeightStore
from forge_rl.weights.store import (
    TensorSpec,
    VersionUnavailable,
    VersionWriter,
    WeightMismatch,
    WeightStore,
    WeightStoreConfig,
    WeightStoreFull,
    check_spec,
    spec_of,
)

__all__ = [
    "ShmVersionWriter",
    "ShmWeightStore",
    "TensorSpec",
    "VersionUnavailable",
    "VersionWriter",
    "WeightMismatch",
    "WeightStore",
    "WeightStoreConfig",
    "WeightStoreFull",
    "check_spec",
    "cleanup_stale_runs",
    "register_process",
    "remove_run",
    "spec_of",
]
