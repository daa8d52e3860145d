"""The ranks of a W-rank run, one after another in this process: each in torch's fake process group, whose
collectives do nothing, so a rank's memory is what it would be with the others there.

    exchange = ObjectExchange(world)
    for rank in range(world):
        with fake_rank(rank, world, exchange):
            ...                                       # the rank's own code: dist.get_rank() == rank

Tensor collectives need nothing more: they move no data, and the rehearsal looks at shapes and memory only. Object
collectives carry decisions (which rank sends which block, what rank 0 could open), so `ObjectExchange` gives each
rank what the others said: the objects of each rank's k-th object collective in a phase are recorded, and a rank
gets the others' latest, from an earlier pass over the ranks for those after it (`passes` in run.py). What a
rank has not heard yet is its own object.
"""

import contextlib
import os

import torch.distributed as dist

from forge_rl.deps.pytorch import FAKE_BACKEND, fake_store, forget_dtensor_caches


class ObjectExchange:
    def __init__(self, world: int):
        self.world = world
        self.said: dict[tuple[str, int], dict[int, object]] = {}  # (phase, k) -> rank -> its object
        self.phase_name, self.calls, self.rank = "", 0, 0

    def start(self, rank: int, phase: str) -> None:
        self.rank, self.phase_name, self.calls = rank, phase, 0

    def _heard(self, obj) -> dict[int, object]:
        key = (self.phase_name, self.calls)
        self.calls += 1
        heard = self.said.setdefault(key, {})
        heard[self.rank] = obj
        return heard

    def all_gather_object(self, object_list, obj, group=None):
        heard = self._heard(obj)
        object_list[:] = [heard.get(r, obj) for r in range(self.world)]

    def broadcast_object_list(self, object_list, src=0, group=None, device=None, group_src=None):
        heard = self._heard(list(object_list))
        object_list[:] = heard.get(src, object_list)

    def gather_object(self, obj, object_gather_list=None, dst=0, group=None, group_dst=None):
        heard = self._heard(obj)
        if object_gather_list is not None:
            object_gather_list[:] = [heard.get(r, obj) for r in range(self.world)]

    def scatter_object_list(
        self, scatter_object_output_list, scatter_object_input_list=None, src=0, group=None, group_src=None
    ):
        heard = self._heard(scatter_object_input_list)
        sent = heard.get(src) or scatter_object_input_list
        scatter_object_output_list[0] = sent[self.rank] if sent else None

    NAMES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")


@contextlib.contextmanager
def fake_rank(rank: int, world: int, exchange: ObjectExchange, local_world: int | None = None):
    """This process as rank `rank` of `world` (fake process group, object collectives through `exchange`), with
    LOCAL_WORLD_SIZE = `local_world` (ranks per host; default all on one)."""
    saved = {name: getattr(dist, name) for name in ObjectExchange.NAMES}
    env = {k: os.environ.get(k) for k in ("LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    local = local_world or world
    os.environ.update(LOCAL_WORLD_SIZE=str(local), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % local))
    dist.init_process_group(FAKE_BACKEND, store=fake_store(), rank=rank, world_size=world)
    for name in ObjectExchange.NAMES:
        setattr(dist, name, getattr(exchange, name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        dist.destroy_process_group()
        forget_dtensor_caches()  # the next rank's meshes equal this one's: it must not be handed this one's groups
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
