"""A Trainer whose publishing settings a test can change between pushes (importable by the procs Monarch spawns).

Publishing settings are fixed for a run; a test of every way out of one layout (each rank writing its own shards,
rank 0 writing what every rank sends it, in whole tensors or in blocks of rows) changes them on one live trainer
instead of starting a trainer per setting. Everything else is the real Trainer."""

from monarch.actor import endpoint

from forge_rl.actors.trainer import Trainer


class PublishSettingTrainer(Trainer):
    @endpoint
    async def set_publishing(self, publish_from: str, block_mb: float) -> None:
        self.cfg.publish_from, self.cfg.publish_block_mb = publish_from, block_mb
