"""A meter of the bytes this process puts into actor calls: what the controller sends per training step.

Monarch serialises an endpoint call's arguments once per call (monarch/_src/actor/actor_mesh.py,
`_create_endpoint_message` -> `pickle(..., allow_tensor_engine_references=True)`); tensors travel inside that buffer.
`.call_one` sends the buffer to one actor, `.call` and `.broadcast` to every actor of the mesh. While the meter is
open, each call's buffer size is recorded in call order:

    with sent_bytes() as sent:
        await asyncio.gather(*(rank.step.call_one(b) for rank, b in trainer_ranks.sending(batches)))
    sent.calls  # [bytes to rank 0, bytes to rank 1, ...]

For tests and benchmarks (it wraps a private function of Monarch 0.7; not for use in a run). Results coming back and
messages sent by other processes are not counted.
"""

import contextlib
from dataclasses import dataclass, field
from collections.abc import Iterator


@dataclass
class SentBytes:
    calls: list[int] = field(default_factory=list)  # serialised size of each endpoint call's arguments

    @property
    def total(self) -> int:
        return sum(self.calls)


@contextlib.contextmanager
def sent_bytes() -> Iterator[SentBytes]:
    import monarch._src.actor.actor_mesh as actor_mesh

    meter = SentBytes()
    real = actor_mesh.pickle

    def counting(obj, *args, **kwargs):
        state = real(obj, *args, **kwargs)
        if kwargs.get("allow_tensor_engine_references"):  # an endpoint call's arguments (results and spawns: not)
            meter.calls.append(len(state.buffer()))
        return state

    actor_mesh.pickle = counting
    try:
        yield meter
    finally:
        actor_mesh.pickle = real


def message_bytes(*args, **kwargs) -> int:
    """The size of the buffer Monarch would send for an endpoint call with these arguments."""
    from monarch._src.actor.actor_mesh import pickle

    return len(pickle((args, kwargs), allow_tensor_engine_references=True, allow_mesh_references=True).buffer())
