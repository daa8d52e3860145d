"""PyTorch 2.13 names forge_rl uses beyond its public API.

- `local_shape_and_global_offset(dtensor)`: where a rank's shard of a DTensor sits in the whole tensor
  (torch.distributed.tensor._utils.compute_local_shape_and_global_offset). DTensor has no public accessor for
  a shard's offset; each trainer rank writes its shard at that offset into the published weights file
  (forge_rl/weights/shards.py) instead of gathering the whole tensor.
"""


def local_shape_and_global_offset(tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(shape), tuple(offset)
