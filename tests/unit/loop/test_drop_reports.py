"""What a run says about dropped groups: repeated drops summarised per reason per interval (not a line per
group), and a run without a batch names the drop reason that dominates (not "the generator is stuck")."""

from forge_rl.loop.rollout import DropLog
from forge_rl.loop.train_loop import RunState, why_no_batch
from forge_rl.recipes.grpo_config import GRPOConfig


def test_repeated_drops_are_summarised_per_reason_per_interval():
    lines = []
    log = DropLog(interval_s=3600, write=lines.append)
    for i in range(500):
        log.dropped(f"g{i}", "reward_timeout", f"reward 'hangs' took longer than reward_timeout_s=2 (call {i})")
    log.dropped("g500", "reward_crash", "reward 'segfaults' crashed its worker")
    assert len(lines) == 2  # the first of each reason, in full
    assert lines[0].startswith("dropped group g0 (reward_timeout): reward 'hangs' took longer")
    log.flush()
    assert len(lines) == 3
    assert "reward_timeout 499 (latest: reward 'hangs' took longer than reward_timeout_s=2 (call 499))" in lines[2]
    log.flush()
    assert len(lines) == 3  # nothing new: nothing printed


def no_batch_message(drops: dict[str, int], added: int = 0) -> str:
    run = RunState(GRPOConfig(batch_groups=4))
    run.rollouts.drops.update(drops)
    buffer = {"added": added, "groups": 0, "dropped": {"stale": 0, "zero_advantage": 0}}
    before = {"added": 0, "groups": 0, "dropped": {"stale": 0, "zero_advantage": 0}}
    return why_no_batch(run, before, buffer, {})


def test_no_batch_names_the_dominant_drop_reason():
    for reason, why in [
        ("reward_timeout", "longer than reward_timeout_s"),
        ("reward_crash", "worker process dies"),
        ("reward_memory", "past reward_memory_mb"),
        ("reward_error", "raises or returns"),
    ]:
        message = no_batch_message({reason: 40, "reward_error" if reason != "reward_error" else "reward_crash": 4})
        assert f"most groups were dropped for {reason} (40 episodes)" in message and why in message, message
        assert "generator is stuck" not in message
    assert "generator is stuck" in no_batch_message({})
