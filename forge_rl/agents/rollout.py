"""Agents as a task: a group of G episodes of one example, each the agent's function run against its own episode
URL, turned into one Group of the trajectories the engine sampled.

    agents = AgentRunner(server, entry, max_concurrent_episodes=64)
    group = await agents.group(example, group_size=8, reward=reward_actor, stats=stats)

The G episodes run concurrently (at most agent.max_concurrent_episodes in the whole run). Each episode's reward
is what the agent returned, or the run's reward functions' score of its last reply. Advantages are relative to the
group's G episode rewards, and every trajectory of an episode (one, unless the episode was split or branched:
forge_rl/agents/episodes.py) carries its episode's advantage; a group may so hold more than G trajectories, which
the buffer and the trainer take as they come (each trajectory is one sequence of the batch). Their common prompt
is the longest prefix all of them share; each one's tokens between it and its first sampled token are context
(masked, as a template's continuations are).

A failure costs its group, never the run: an episode that raises, times out, returns a non-number, makes no call,
or whose call was refused (a different sampler, a prompt too long, a non-prefix call under `refuse`) drops the
group, counted in RolloutStats.drops under its reason and printed as one line (rollout.DropLog). An agent that
fails on each of its first FAIL_FAST_GROUPS groups, never completing one, stops the run (`AgentFailing`). When one
episode fails the group's others are cancelled; nothing is left running.
"""

import asyncio

from forge_rl.actors.reward import RewardActor
from forge_rl.agents.entry import AgentEntry, AgentReward, EpisodeFailed
from forge_rl.agents.episodes import EpisodeRecord, shared_prompt_len, trajectory_completion
from forge_rl.agents.gateway_client import GatewayClient
from forge_rl.agents.gateways import Gateways
from forge_rl.agents.server import AgentServer
from forge_rl.agents.workers import AgentWorkers
from forge_rl.actors.dataset import PromptDataset
from forge_rl.actors.replay_buffer import ReplayBuffer
from forge_rl.deps.monarch import SupervisionError
from forge_rl.errors import RunStopped
from forge_rl.loop.rollout import FAIL_FAST_GROUPS, KEPT_OVER_CAP
from forge_rl.losses.advantages import group_advantages
from forge_rl.runtime.replies import replies
from forge_rl.types import Episode, Group

# drop reasons that are the agent's own (a reward function's and the generator's have theirs)
AGENT_REASONS = (
    "agent_error",
    "agent_timeout",
    "agent_reward",
    "agent_no_calls",
    "agent_request",
    "agent_non_prefix",
    "agent_output",  # an agent.command program's stdout over agent.max_output_bytes
    "agent_worker_lost",  # the agent worker playing an episode died (forge_rl/agents/workers.py)
    "agent_gateway_lost",  # the gateway holding an episode's calls died (forge_rl/agents/gateway_client.py)
)


class AgentFailing(RunStopped):
    """The agent failed on each of its first FAIL_FAST_GROUPS groups: the run stops with its error."""


class AgentRunner:
    """The run's agent: its endpoint (gateway processes', GatewayClient or Gateways, or served here, AgentServer:
    the same `open`, `close` and `base_url`), what plays its episodes (its agent workers, AgentWorkers, or its function
    in this process, AgentEntry: the same `run`), and how many of its episodes may run at once."""

    def __init__(
        self,
        server: AgentServer | GatewayClient | Gateways,
        entry: AgentEntry | AgentWorkers,
        max_concurrent_episodes: int,
    ):
        self.server, self.entry = server, entry
        # an agent whose episodes share one client of the root URL (verifiers') calls it with the run's key
        if (use_run_key := getattr(entry.fn, "use_run_key", None)) is not None:
            use_run_key(server.run_key)
        self.slots = asyncio.Semaphore(max_concurrent_episodes)
        self.groups_done = 0  # groups that produced a Group, ever
        self.groups_failed = 0  # groups lost to the agent's own failures before any was done

    async def close(self) -> None:
        """Stop the endpoint (the port released) and the sync agents' threads."""
        await self.server.stop()
        await self.entry.close()

    async def episode(self, example, trained: bool) -> tuple[EpisodeRecord, float | None]:
        """Run one episode: its record and the agent's reward (None: the reward functions score it). Raises
        EpisodeFailed naming the failure (the first refused call's, if any, else the agent's)."""
        async with self.slots:
            episode = await self.server.open(example, trained)
            url, failed = self.server.base_url(episode), None
            try:
                reward = await self._played(example, url, episode)
            except EpisodeFailed as e:
                failed = e
            finally:  # the record of its calls, from wherever the endpoint runs (a gateway that died: its failure)
                record = await asyncio.shield(self.server.close(episode))
            if failed is not None:
                if record.failure is not None:  # the refused call is why (the agent then raised on its 400)
                    raise EpisodeFailed(*record.failure)
                raise EpisodeFailed(failed.reason, f"episode {record.id}: {failed}")
            if record.failure is not None:  # a refused call the agent went on after
                raise EpisodeFailed(*record.failure)
            if record.calls == 0:
                raise EpisodeFailed(
                    "agent_no_calls",
                    f"agent {self.entry.path} made no call through its episode's client (base URL {url}): nothing "
                    "to train on",
                )
            if isinstance(reward, AgentReward):  # the parts stay with the episode's record
                reward, record.reward_parts = reward
            return record, reward

    async def _played(self, example, url: str, episode):
        """The agent's reward for `episode`; when the gateway holding its calls dies first, the agent is stopped
        and the episode fails as that (what it recorded went with the gateway)."""
        died = getattr(self.server, "died", None)
        if died is None:  # an endpoint in this process: it ends with the run only
            return await self.entry.run(example, url, episode.key)
        play = asyncio.ensure_future(self.entry.run(example, url, episode.key))
        lost = asyncio.ensure_future(died(episode).wait())
        try:
            await asyncio.wait({play, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (play, lost):
                if not task.done():
                    task.cancel()
            await asyncio.gather(play, lost, return_exceptions=True)
        if play.done() and not play.cancelled():
            return play.result()
        raise EpisodeFailed("agent_gateway_lost", f"episode {episode.id}: the agent gateway holding its calls died")

    async def episodes(self, example, n: int, trained: bool) -> list[tuple[EpisodeRecord, float | None]]:
        """`n` episodes of `example` at once; the first failure cancels the others and is raised."""
        tasks = [asyncio.ensure_future(self.episode(example, trained)) for _ in range(n)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def group(self, example, group_size: int, reward, stats, scale_advantages_by_std: bool = True):
        """A Group of `example`'s `group_size` episodes, or None (dropped, counted and logged)."""
        try:
            done = await self.episodes(example, group_size, trained=True)
            rewards = await self._rewards(example, done, reward)
        except EpisodeFailed as e:
            self._failed(example.id, e, group_size, stats)
            return None
        except (SupervisionError, RunStopped):  # a dead role, or no agent worker left: the run's, not the group's
            raise
        except Exception as e:  # a reward function failed on the last replies: as for any task's group
            failure = getattr(e, "exception", e)
            stats.reward_failed(example.id, failure, group_size)
            return None
        self.groups_done += 1
        return self._group(example, done, rewards, stats, scale_advantages_by_std)

    async def _rewards(self, example, done: list, reward) -> list[float]:
        """Each episode's reward: the agent's, or the reward functions' score of its last reply."""
        unscored = [i for i, (_, r) in enumerate(done) if r is None]
        rewards = [r for _, r in done]
        if unscored:
            records = [done[i][0] for i in unscored]
            n = len(records)
            totals, _ = await replies().call(
                reward,
                RewardActor.score,
                [example.prompt] * n,
                [r.final_text or "" for r in records],
                [r.final_finish for r in records],
                {k: [v] * n for k, v in example.columns.items()},
            )
            for i, total in zip(unscored, totals):
                rewards[i] = float(total)
        return rewards

    def _group(self, example, done: list, rewards: list[float], stats, scale_by_std: bool) -> Group | None:
        trajectories = [(k, t) for k, (record, _) in enumerate(done) for t in record.trajectories]
        prompt_len = shared_prompt_len([t for _, t in trajectories])
        if prompt_len == 0:
            failure = EpisodeFailed("agent_prompts_differ", "its episodes share no prompt token")
            self._failed(example.id, failure, len(done), stats)
            return None
        tokenizer = self.server.tokenizer
        completions = [trajectory_completion(t, prompt_len, tokenizer) for _, t in trajectories]
        if over := sum(c.kept_over_cap > 0 for c in completions):  # trained whole or not at all
            stats.drops[KEPT_OVER_CAP] = stats.drops.get(KEPT_OVER_CAP, 0) + len(done)
            stats.drop_log.dropped(
                example.id,
                KEPT_OVER_CAP,
                f"{over} trajectories drew a token from more tokens than the "
                "generator records (generator.max_kept_tokens)",
            )
            return None
        advantages = group_advantages(rewards, scale_by_std=scale_by_std)
        stats.generated_tokens += sum(int((~c.env_mask).sum()) for c in completions)
        stats.rewards += rewards
        records = [record for record, _ in done]
        for name, values in (
            ("solved", [float(r > 0) for r in rewards]),
            ("agent_calls", [float(r.calls) for r in records]),
            ("agent_trajectories", [float(len(r.trajectories)) for r in records]),
            ("agent_splits", [float(r.splits) for r in records]),
        ):
            stats.parts.setdefault(name, []).extend(values)
        for name in sorted({name for r in records for name in r.reward_parts or {}}):  # a rubric's functions
            stats.parts.setdefault(name, []).extend(float((r.reward_parts or {}).get(name, 0.0)) for r in records)
        episodes = [
            Episode(
                c,
                reward=rewards[k],
                rewards=records[k].reward_parts or {"agent": rewards[k]},
                advantage=advantages[k],
                metadata={"example": example.id, "episode": k, "calls": records[k].calls},
            )
            for (k, _), c in zip(trajectories, completions)
        ]
        return Group(example.id, episodes)

    def _failed(self, example_id: str, failure: EpisodeFailed, group_size: int, stats) -> None:
        """Count and log a dropped group; AgentFailing when the agent has failed on each of its first groups."""
        reason = failure.reason
        # prompt_too_long counts prompts, as single-turn and multi-turn rollouts do; the rest count episodes
        stats.drops[reason] = stats.drops.get(reason, 0) + (1 if reason == "prompt_too_long" else group_size)
        stats.drop_log.dropped(example_id, reason, str(failure))
        if reason in AGENT_REASONS and not self.groups_done:
            self.groups_failed += 1
            if self.groups_failed >= FAIL_FAST_GROUPS:
                raise AgentFailing(
                    f"agent {self.entry.path} failed on each of the first {FAIL_FAST_GROUPS} groups it played "
                    f"({reason}), so the run stops: {str(failure).splitlines()[0][:300]}"
                )


async def rollout_agent_from_dataset(
    *, agents: AgentRunner, dataset, reward, buffer, group_size: int, stats, scale_advantages_by_std: bool = True
) -> bool:
    """One agent group of the dataset actor's next example into the buffer. True if stored."""
    calls = replies()  # not call_one: Monarch never frees a call_one's reply port (runtime/replies.py)
    example = await calls.call(dataset, PromptDataset.next)
    group = await agents.group(example, group_size, reward, stats, scale_advantages_by_std)
    return group is not None and await calls.call(buffer, ReplayBuffer.add, group)
