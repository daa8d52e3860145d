"""A generator's LoRA adapters are dropped once each, whatever calls drop them at the same time: requests ending on
old adapters and keep_adapters interleave at the engine's remove_lora (each awaits it), and none may find an
adapter another already took."""

import asyncio
from types import SimpleNamespace

from forge_rl.actors.generator_weights import GeneratorWeights


class SlowRemoval:
    """The engine's remove_lora as it behaves here: it yields to the event loop before it returns."""

    def __init__(self):
        self.removed: list[int] = []

    async def remove_lora(self, lora_id: int) -> None:
        await asyncio.sleep(0)
        self.removed.append(lora_id)


def generator_with_adapters(versions: list[int], current: int) -> GeneratorWeights:
    generator = GeneratorWeights()
    generator._init_weights()
    generator.engine, generator.lora, generator.policy_version = SlowRemoval(), object(), current
    generator._adapters = {v: SimpleNamespace(lora_int_id=v, lora_path=f"/nonexistent/{v}") for v in versions}
    return generator


def test_concurrent_drops_remove_each_old_adapter_once_and_keep_the_rest():
    generator = generator_with_adapters([1, 2, 3, 4, 5, 6], current=6)
    generator._adapter_users = {1: 1, 2: 1}  # two requests still running on old adapters

    async def race() -> None:
        await asyncio.gather(
            generator._done_with_adapter(1),
            generator._done_with_adapter(2),
            generator._keep_adapters([4, 5]),
            generator._keep_adapters([5]),
        )

    asyncio.run(race())
    assert sorted(generator.engine.removed) == [1, 2, 3, 4]  # each once; 4 went when the later keep left it out
    assert sorted(generator._adapters) == [5, 6]


def test_an_adapter_in_use_or_kept_stays():
    generator = generator_with_adapters([1, 2, 3], current=3)
    generator._adapter_users = {1: 1}
    asyncio.run(generator._keep_adapters([2]))
    assert generator.engine.removed == [] and sorted(generator._adapters) == [1, 2, 3]
