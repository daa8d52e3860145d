"""A real RewardModel with one fault injected (importable by the procs Monarch spawns)."""

from forge_rl.actors.reward_model import RewardModel


class PoisonedRewardModel(RewardModel):
    """Its forward fails on any text holding "POISON": one bad request must fail alone, not the batch it ran in."""

    def _forward(self, texts: list[str]) -> list[float]:
        if any("POISON" in t for t in texts):
            raise RuntimeError("a forward failed on a poisoned input")
        return super()._forward(texts)
