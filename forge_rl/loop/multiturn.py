"""Multi-turn rollouts: one token sequence per trajectory, continued turn after turn with an environment.

    renderer = TurnRenderer(tokenizer)
    group = await rollout_env_group(example, prompt_ids, generator, make_env, renderer, env_cfg, group_size=8,
                                    max_tokens=8, stats=stats)

The first turn samples the group in one engine request (n=G); each trajectory then goes on alone: the
environment reads the model's reply (`Environment.step`), its messages are rendered by the chat template
into tokens appended to the sequence with `env_mask` set (no loss, no logprob), and the generator continues
from the whole sequence so far. Model tokens keep their behaviour logprobs and policy versions across turns;
the environment's tokens carry the version of the model token before them, so staleness is the model's.
Limits: `env.max_turns` model turns and `env.max_total_tokens` response tokens (the environment's included).

An environment whose `reset` returns chat messages poses its own prompt (an OpenEnv environment's first
observation): the group's first turn is generated from those, rendered by the chat template, and every
trajectory of the group must get the same ones. Each step's reward is kept (`Episode.metadata["step_rewards"]`);
the trajectory's reward is their sum. Every environment is closed when its trajectory ends, however it ends.

A failure costs its group, never the run: an environment that raises (building it, `reset`, `step`, rendering
its messages) drops the group as `env_error` (or the reason an `EnvError` names, e.g. `env_timeout`), a
generation that fails as `generation_error` (a sequence grown too long for the engine as `prompt_too_long`), a
reward that fails in its worker (ToolEnv's final answer) under its own reason (`reward_timeout`, ...). Each is
counted in `RolloutStats.drops` (logged as drops/<reason>) and printed as one line. An environment that fails on
FAIL_FAST_GROUPS groups in a row, none succeeding in between, stops the run (`EnvFailing`, its latest error): a
broken environment or a server that died. In evaluation the example counts as not solved. A generator proc that
died is the run's.
"""

import asyncio
from dataclasses import dataclass

import torch

from forge_rl.actors.dataset import PromptDataset
from forge_rl.actors.replay_buffer import ReplayBuffer
from forge_rl.deps.monarch import SupervisionError
from forge_rl.envs.base import EnvConfig, Environment
from forge_rl.envs.environment import EVAL_TRAJECTORIES, EnvError, EnvStep
from forge_rl.errors import RunStopped
from forge_rl.loop.rollout import FAIL_FAST_GROUPS, KEPT_OVER_CAP
from forge_rl.loop.turn_renderer import TurnRenderer
from forge_rl.loop.turn_images import TurnImages
from forge_rl.losses.advantages import group_advantages
from forge_rl.rewards.workers import RewardError
from forge_rl.runtime.replies import replies
from forge_rl.types import Completion, Episode, Group


class GenerationError(RuntimeError):
    """The generator failed on a turn (its error is the __cause__); the rollout drops the group."""


class EnvFailing(RunStopped):
    """The environment failed on FAIL_FAST_GROUPS groups in a row: the run stops with its latest error."""


async def generate(generator, prompt_ids: list[int], **kwargs) -> list[Completion]:
    """generator.generate, its failures told apart from the environment's (a dead generator proc is the run's)."""
    try:
        return await generator.generate.route(prompt_ids, **kwargs)
    except SupervisionError:
        raise
    except Exception as e:
        raise GenerationError(f"{type(getattr(e, 'exception', e)).__name__}: {e}") from e


async def next_turn(generator, prompt_ids: list[int], pictures: TurnImages, max_tokens: int, sampling: dict):
    """The model's turn after the environment's: one sample of the conversation as sent, with its images."""
    turn = await generate(generator, prompt_ids, n=1, max_tokens=max_tokens, **pictures.generate_args(), **sampling)
    return turn[0]


def drop_reason(error: Exception) -> str:
    """The counted reason a multi-turn group is dropped for (RolloutStats.drops, drops/<reason>)."""
    from forge_rl.actors.generator import PromptTooLong

    if isinstance(error, GenerationError):
        cause = getattr(error.__cause__, "exception", error.__cause__)
        return "prompt_too_long" if isinstance(cause, PromptTooLong) else "generation_error"
    if isinstance(error, (RewardError, EnvError)):  # ToolEnv's reward in its worker; an environment's own reason
        return error.reason
    return "env_error"  # reset, step, or rendering the environment's messages


class KeptSets:
    """A trajectory's kept sets (truncated sampling), CSR as Completion holds them: each model turn's as recorded,
    none for the environment's tokens. Not recorded when a turn has none (untruncated) or exceeded the cap."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.offsets: list[int] = [0]
        self.recorded = True
        self.over_cap = 0

    def add_turn(self, turn: Completion) -> None:
        self.over_cap += turn.kept_over_cap
        if turn.kept_offsets is None:
            self.recorded = False
            return
        self.offsets += (turn.kept_offsets[1:].long() + len(self.ids)).tolist()
        self.ids += turn.kept_ids.tolist()

    def add_inserted(self, n: int) -> None:
        self.offsets += [len(self.ids)] * n

    def fields(self) -> dict:
        """Completion's kept_ids, kept_offsets and kept_over_cap."""
        if not self.recorded:
            return dict(kept_over_cap=self.over_cap)
        return dict(
            kept_ids=torch.tensor(self.ids, dtype=torch.int32),
            kept_offsets=torch.tensor(self.offsets, dtype=torch.int32),
            kept_over_cap=self.over_cap,
        )


class TurnRoutes:
    """A trajectory's routes (Keep Routing), as Completion holds them: turn k's engine request ran the positions
    0 .. its prompt + response - 2, the whole trajectory so far; each position keeps the routing of the first turn
    that ran it, so a model turn's tokens keep the experts they were generated through, and the environment's
    tokens (and each turn's last token) the experts of the turn that read them. None when a turn has none."""

    def __init__(self) -> None:
        self.routes: torch.Tensor | None = None
        self.recorded = True

    def add_turn(self, turn: Completion) -> None:
        if turn.routes is None:
            self.recorded = False
        elif self.recorded:
            self.routes = (
                turn.routes if self.routes is None else torch.cat([self.routes, turn.routes[len(self.routes) :]])
            )

    def fields(self) -> dict:
        return dict(routes=self.routes) if self.recorded and self.routes is not None else {}


@dataclass
class Trajectory:
    completion: Completion | None  # None: an evaluation's example that failed
    reward: float  # the sum of step_rewards
    solved: bool
    turns: int
    step_rewards: tuple[float, ...] = ()  # each environment step's reward, in order


async def play(
    env: Environment,
    first: Completion,
    prompt_ids: list[int],
    generator,
    renderer: TurnRenderer,
    env_cfg: EnvConfig,
    max_tokens: int,
    images=(),
    **sampling,
) -> Trajectory:
    """Continue one trajectory from its first model turn until the environment is done or a limit is hit.
    `images`: the prompt's (forge_rl/loop/turn_images.py: those of the environment's steps join them)."""
    ids: list[int] = []  # the response as the engine ran it (an environment's image placeholders expanded)
    sent, pictures = [], TurnImages(images)  # the response as sent to the generator (placeholders unexpanded)
    logprobs: list[float] = []
    versions: list[int] = []
    from_env: list[bool] = []
    kept = KeptSets()  # truncated sampling: each token's kept set, the environment's tokens none
    routes = TurnRoutes()  # Keep Routing: the experts each position was routed to
    history: list[dict[str, str]] = []  # the model's turns and the environment's messages, after the prompt
    turn, solved, turns = first, False, 0
    step_rewards: list[float] = []
    finish = first.finish_reason
    while True:
        turns += 1
        ids += turn.response_ids.tolist()
        sent += turn.response_ids.tolist()
        logprobs += turn.logprobs.tolist()
        versions += turn.policy_versions.tolist()
        from_env += [False] * len(turn.response_ids)
        kept.add_turn(turn)
        routes.add_turn(turn)
        finish = turn.finish_reason
        step = await env.step(turn.text)
        step_rewards.append(float(step.reward))
        solved = solved or step.solved
        if step.done or turns >= env_cfg.max_turns or not step.messages:
            break
        messages = pictures.messages(step, f"environment step {turns}")
        inserted = renderer.between(
            messages, model_stopped=turn.finish_reason == "stop", reply=turn.text, earlier=history
        )
        history += [{"role": "assistant", "content": turn.text}, *messages]
        room = env_cfg.max_total_tokens - len(ids) - len(inserted)
        if room < 1:  # no room for the environment's turn and a reply to it
            finish = "length"
            break
        sent += inserted
        turn = await next_turn(generator, prompt_ids + sent, pictures, min(max_tokens, room), sampling)
        inserted = pictures.expanded(inserted, turn, len(first.prompt_ids) + len(ids))
        ids += inserted
        logprobs += [0.0] * len(inserted)
        versions += [versions[-1] if versions else 0] * len(inserted)
        from_env += [True] * len(inserted)
        kept.add_inserted(len(inserted))
    completion = Completion(
        prompt_ids=first.prompt_ids,
        response_ids=torch.tensor(ids, dtype=torch.long),
        logprobs=torch.tensor(logprobs, dtype=torch.float32),
        policy_versions=torch.tensor(versions, dtype=torch.long),
        finish_reason=finish,
        text=renderer.tokenizer.decode(ids, skip_special_tokens=True),
        prompt=first.prompt,
        env_mask=torch.tensor(from_env, dtype=torch.bool),
        sampling=first.sampling,
        **kept.fields(),
        **routes.fields(),
        images=tuple(pictures.images),
    )
    return Trajectory(completion, sum(step_rewards), solved, turns, tuple(step_rewards))


async def play_group(
    example,
    prompt_ids: list[int],
    generator,
    make_env,
    renderer: TurnRenderer,
    env_cfg: EnvConfig,
    n: int,
    max_tokens: int,
    **sampling,
) -> list[Trajectory]:
    """`n` trajectories of one example: the first turns in one engine request, the rest concurrently. The
    environments are closed when the group ends, however it ends."""
    envs: list[Environment] = []
    try:
        envs += [make_env() for _ in range(n)]
        posed = posed_prompt(await asyncio.gather(*(env.reset(example) for env in envs)), renderer, example)
        prompt_ids, images = posed or (prompt_ids, tuple(getattr(example, "images", ())))
        budget = min(max_tokens, env_cfg.max_total_tokens)
        first = await generate(
            generator, prompt_ids, n=n, max_tokens=budget, **TurnImages(images).generate_args(), **sampling
        )
        return list(
            await asyncio.gather(
                *(
                    play(env, c, prompt_ids, generator, renderer, env_cfg, max_tokens, images, **sampling)
                    for env, c in zip(envs, first)
                )
            )
        )
    finally:
        await close_all(envs)


def posed_prompt(posed: list, renderer: TurnRenderer, example) -> tuple[list[int], tuple[bytes, ...]] | None:
    """The prompt the environments posed at reset (one for the whole group), as token ids, with the images it shows
    (an EnvStep's: forge_rl/loop/turn_images.py); None: the example's."""
    if all(p is None for p in posed):
        return None
    if any(p != posed[0] for p in posed):
        raise ValueError(
            f"the environments of example {example.id}'s group posed different prompts at reset: every trajectory "
            "of a group must start on the same task (the same seed and reset arguments must give the same one)"
        )
    step = posed[0] if isinstance(posed[0], EnvStep) else EnvStep(messages=posed[0])
    pictures = TurnImages()
    messages = pictures.messages(step, f"example {example.id}'s reset")
    return renderer.prompt(messages), tuple(pictures.images)


async def close_all(envs: list[Environment]) -> None:
    """Close every environment; a close that fails is printed (one line) and does not hide the group's result."""
    closed = await asyncio.gather(*(env.close() for env in envs), return_exceptions=True)
    for error in closed:
        if isinstance(error, Exception):
            print(f"environment close failed: {type(error).__name__}: {error}".splitlines()[0][:200], flush=True)


async def rollout_env_group(
    example,
    prompt_ids: list[int],
    generator,
    make_env,
    renderer: TurnRenderer,
    env_cfg: EnvConfig,
    group_size: int,
    max_tokens: int,
    stats,
    scale_advantages_by_std: bool = True,
) -> Group | None:
    """A group of `group_size` trajectories, rewarded by the environment, with group-relative advantages.
    None when an environment or a generation failed: the group is dropped, counted and logged (rollout.DropLog)."""
    try:
        trajectories = await play_group(
            example, prompt_ids, generator, make_env, renderer, env_cfg, group_size, max_tokens
        )
    except SupervisionError:
        raise  # a role died: the run's to handle (RoleDied), not one group's
    except Exception as e:
        reason = drop_reason(e)
        # prompt_too_long counts prompts, as in single-turn rollouts; every other reason counts episodes
        stats.drops[reason] = stats.drops.get(reason, 0) + (1 if reason == "prompt_too_long" else group_size)
        stats.drop_log.dropped(example.id, reason, f"{type(e).__name__}: {e}")
        count_env_failure(make_env, reason, e)
        return None
    if hasattr(make_env, "failures_in_a_row"):
        make_env.failures_in_a_row = 0
    stats.generated_tokens += sum(int((~t.completion.env_mask).sum()) for t in trajectories)
    if over := sum(t.completion.kept_over_cap > 0 for t in trajectories):  # trained whole or not at all
        stats.drops[KEPT_OVER_CAP] = stats.drops.get(KEPT_OVER_CAP, 0) + group_size
        stats.drop_log.dropped(
            example.id,
            KEPT_OVER_CAP,
            f"{over} of its {group_size} trajectories drew a token "
            "from more tokens than the generator records (generator.max_kept_tokens)",
        )
        return None
    rewards = [t.reward for t in trajectories]
    stats.rewards += rewards
    for name, values in (
        ("env", rewards),
        ("solved", [float(t.solved) for t in trajectories]),
        ("turns", [float(t.turns) for t in trajectories]),
    ):
        stats.parts.setdefault(name, []).extend(values)
    advantages = group_advantages(rewards, scale_by_std=scale_advantages_by_std)
    return Group(
        example.id,
        [
            Episode(
                t.completion,
                reward=t.reward,
                rewards={"env": t.reward, "solved": float(t.solved)},
                advantage=a,
                metadata={"example": example.id, "turns": t.turns, "step_rewards": list(t.step_rewards)},
            )
            for t, a in zip(trajectories, advantages)
        ],
    )


def count_env_failure(make_env, reason: str, error: Exception) -> None:
    """One more group the environment failed on; EnvFailing once FAIL_FAST_GROUPS fail in a row."""
    if not reason.startswith("env_") or not hasattr(make_env, "failures_in_a_row"):
        return
    make_env.failures_in_a_row += 1
    if make_env.failures_in_a_row >= FAIL_FAST_GROUPS:
        raise EnvFailing(
            f"the environment failed on {make_env.failures_in_a_row} groups in a row, none succeeding in between "
            f"({reason}; latest: {type(error).__name__}: {str(error).strip()[:300]}), so the run stops"
        ) from None


async def rollout_env_from_dataset(
    *,
    dataset,
    generator,
    buffer,
    make_env,
    renderer: TurnRenderer,
    env_cfg: EnvConfig,
    group_size: int,
    max_tokens: int,
    stats,
    scale_advantages_by_std: bool = True,
) -> bool:
    """One multi-turn group of the dataset actor's next example into the buffer. True if stored; False when the
    group was dropped (see rollout_env_group)."""
    calls = replies()  # not call_one: Monarch never frees a call_one's reply port (runtime/replies.py)
    example = await calls.call(dataset, PromptDataset.next)
    prompt_ids = renderer.tokenizer(example.text, add_special_tokens=False)["input_ids"]
    group = await rollout_env_group(
        example,
        prompt_ids,
        generator,
        make_env,
        renderer,
        env_cfg,
        group_size,
        max_tokens,
        stats,
        scale_advantages_by_std,
    )
    return group is not None and await calls.call(buffer, ReplayBuffer.add, group)


async def evaluate_env(
    generator,
    examples,
    make_env,
    renderer: TurnRenderer,
    env_cfg: EnvConfig,
    max_tokens: int,
    concurrency: int = EVAL_TRAJECTORIES,
) -> dict:
    """Greedy trajectories of the held-out examples. Returns {"accuracy": fraction solved within
    env.max_turns, "first_turn": fraction solved on the first turn, "reward": mean reward, "turns", "n"}."""
    if not examples:
        raise ValueError("evaluate_env: no held-out examples")
    slots = asyncio.Semaphore(concurrency)

    async def one(example) -> Trajectory:
        async with slots:
            prompt_ids = renderer.tokenizer(example.text, add_special_tokens=False)["input_ids"]
            try:
                return (
                    await play_group(
                        example, prompt_ids, generator, make_env, renderer, env_cfg, 1, max_tokens, temperature=0.0
                    )
                )[0]
            except SupervisionError:
                raise
            except Exception as e:  # an evaluation goes on: this example counts as not solved
                print(
                    f"evaluation: example {example.id} failed ({drop_reason(e)}): {e}".splitlines()[0][:200], flush=True
                )
                return Trajectory(None, 0.0, False, 0)

    return trajectory_scores(await asyncio.gather(*(one(e) for e in examples)))


def trajectory_scores(done: list[Trajectory]) -> dict:
    """What an evaluation reports of its trajectories: the fraction solved (within env.max_turns) and solved on the
    first turn, the mean reward and turns, and how many."""
    n = len(done)
    return {
        "accuracy": sum(t.solved for t in done) / n,
        "first_turn": sum(t.solved and t.turns == 1 for t in done) / n,
        "reward": sum(t.reward for t in done) / n,
        "turns": sum(t.turns for t in done) / n,
        "n": n,
    }
