"""PyTorch 2.13 names forge_rl uses beyond its public API.

- `local_shape_and_global_offset(dtensor)`: where a rank's shard of a DTensor sits in the whole tensor
  (torch.distributed.tensor._utils.compute_local_shape_and_global_offset). DTensor has no public accessor for
  a shard's offset; each trainer rank writes its shard at that offset into the published weights file
  (forge_rl/weights/shards.py) instead of gathering the whole tensor.
"""

import torch


def local_shape_and_global_offset(tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(shape), tuple(offset)


# The rehearsal (forge_rl/rehearsal) runs a trainer rank's own code without its memory: fake tensors (shapes, dtypes
# and storages' sizes, no data) and torch's fake process group (collectives that do nothing, as a real rank's
# memory would be were the others there). PyTorch's FSDP2 memory tracker (torch.distributed._tools) and
# TorchTitan's memory estimation use the same pieces; none is public.
FAKE_BACKEND = "fake"  # torch.distributed's backend name of the fake process group


def fake_store():
    """The store `init_process_group("fake", store=...)` takes (torch.testing's FakeStore)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def fake_tensor_mode(**kwargs):
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(**kwargs)


def is_fake(tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def untyped_storages(tensor) -> set:
    """The storages a tensor holds (a DTensor's local tensor's), as torch's memory tracker counts them."""
    from torch.distributed._tools.common_utils import get_untyped_storages

    return get_untyped_storages(tensor)


def state_dict_name(parameter_name: str) -> str:
    """A parameter's name as the state dict has it: activation checkpointing (TorchTitan's FullAC, torch's
    checkpoint_wrapper) puts `_checkpoint_wrapped_module.` into `named_parameters()`' names and takes it out of
    `state_dict()`'s."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

    return parameter_name.replace(_CHECKPOINT_PREFIX, "")


def forget_dtensor_caches() -> None:
    """Empty DTensor's caches of sharding decisions. They key device meshes by layout, not by the process groups
    behind them, so after one fake rank's groups are destroyed, the next rank in the same process would be handed
    the last one's meshes (and its destroyed groups) from them."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._redistribute import _gen_transform_infos
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
    _gen_transform_infos.cache_clear()
    MeshTopoInfo.build_from_mesh.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()


def in_backward() -> bool:
    """Is autograd running a backward pass in this thread (an activation-checkpointed region recomputing its forward
    is one)?"""
    return torch._C._current_graph_task_id() != -1
