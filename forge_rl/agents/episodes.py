"""One agent episode's calls, recorded as the engine saw them, and the trajectories they make.

Every call of an episode is recorded: the prompt's token ids the engine was given, and for each choice the sampled
ids, their behaviour logprobs and policy versions. A trajectory is one token sequence that grows call after call:
a call whose messages repeat an earlier call's conversation (its messages, then the reply it got, then anything
new) continues that reply's tokens: its prompt is the recorded tokens plus the continuation the chat template puts
after them (forge_rl/agents/conversation.py), and the continuation's tokens are masked in training (`env_mask`), as
an environment's turns are. Only tokens the engine sampled are trained on.

A call that cannot continue any earlier reply (the agent edited or compacted its history, or the template
re-renders earlier turns) is a non-prefix call. With `agent.non_prefix: split` it starts a new trajectory of the
same episode, rendered afresh, that trains on its own sampled tokens; with `refuse` it is refused (`Refused`).
A call that continues a reply another call already continued (the agent branched), or a call's second and later
choices (n > 1), start a trajectory too, whose prompt is the exact recorded tokens up to that point: the shared part
is context there, trained once, in the trajectory that holds it.
"""

from dataclasses import dataclass, field

import torch

from forge_rl.agents.conversation import ChatContinuation, NotAPrefix, same_message, template_message
from forge_rl.loop.multiturn import KeptSets
from forge_rl.types import Completion


class Refused(ValueError):
    """A call the episode refuses (agent.non_prefix: refuse, or a prompt too long): the server answers 400."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class Tip:
    """The end of one reply: what a later call must repeat to continue it, and where its tokens end."""

    trajectory: "Trajectory"
    length: int  # tokens of the trajectory (prompt included) up to the end of this reply
    kind: str  # "chat" or "text" (/v1/completions)
    key: object  # chat: the template messages, this reply last; text: the prompt text and the reply's text
    context: tuple = ()  # chat: (tools, chat template arguments) of the call, which a continuing call must repeat
    model_turns: dict = field(default_factory=dict)  # chat: position in `key` -> the text the model produced there
    stopped: bool = False  # the reply ended with its end-of-turn token (kept in the tokens)
    # text: the end of the reply's tokens that the text returned leaves out (the end-of-turn token, a stop string and
    # what its last token held after it), which a prompt continuing the reply must send right after that text
    hidden: str = ""


@dataclass
class Trajectory:
    """One token sequence of an episode: `prompt_ids` (context), then `ids`, of which `env` marks the tokens the
    engine did not sample (the template's continuations, masked in training)."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    env: list[bool] = field(default_factory=list)
    kept: KeptSets = field(default_factory=KeptSets)
    finish_reason: str = "stop"
    sampling: dict | None = None
    calls: int = 0

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.ids)

    def tokens(self) -> list[int]:
        return self.prompt_ids + self.ids

    def add_inserted(self, ids: list[int]) -> None:
        version = self.versions[-1] if self.versions else 0
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [version] * len(ids)
        self.env += [True] * len(ids)
        self.kept.add_inserted(len(ids))

    def add_reply(self, reply: Completion) -> None:
        n = len(reply.response_ids)
        self.ids += reply.response_ids.tolist()
        self.logprobs += reply.logprobs.tolist()
        self.versions += reply.policy_versions.tolist()
        self.env += [False] * n
        self.kept.add_turn(reply)
        self.finish_reason, self.sampling, self.calls = reply.finish_reason, reply.sampling, self.calls + 1


@dataclass
class Plan:
    """What a call sends the engine, decided before it generates: its prompt, and the reply it continues."""

    prompt_ids: list[int]
    tip: Tip | None = None  # the earlier reply continued; None: a fresh render
    inserted: list[int] = field(default_factory=list)  # the continuation's tokens after that reply
    split: str | None = None  # why a non-prefix call starts a new trajectory (None: it is not one)
    context: tuple = ()  # chat: the call's (tools, chat template arguments)


@dataclass
class Reply:
    """A choice of a call as the agent got it back: the message (chat) or text it will send again to continue, and
    the text the model produced (its tokens decoded whole, the end-of-turn token left out)."""

    completion: Completion
    message: dict | None  # chat: the assistant message returned (template form)
    text: str  # the text returned (/v1/completions), or the message's content
    raw: str
    stopped: bool


class EpisodeRecord:
    """The calls of one episode: its trajectories, their tips, its non-prefix splits and forks."""

    def __init__(self, episode_id: str, example, trained: bool, non_prefix: str, chat: ChatContinuation, key: str = ""):
        self.id, self.example, self.trained, self.non_prefix, self.chat = episode_id, example, trained, non_prefix, chat
        self.key = key  # the bearer key its calls carry (forge_rl/agents/server.py); "" takes none
        self.trajectories: list[Trajectory] = []
        self.tips: list[Tip] = []
        self.calls = self.splits = self.forks = 0
        self.final_text: str | None = None  # the latest call's first choice
        self.final_finish: str = "stop"
        self.failure: tuple[str, str] | None = None  # (reason, message): the first refusal or failure of a call
        self.reward_parts: dict[str, float] | None = None  # the agent's reward's parts (a verifiers rubric's)
        self.replicas: set[int] = set()  # the generator replicas its calls went to (one, unless that one died)
        self.closed = False

    def __getstate__(self) -> dict:
        """A closed record as it travels from the gateway to the controller: its trajectories and counts, without
        the tokenizer (`chat`) and the tips that only later calls of the episode would read."""
        return {**self.__dict__, "chat": None, "tips": []}

    def fail(self, reason: str, message: str) -> None:
        if self.failure is None:
            self.failure = (reason, message)

    # ---- before a call generates ----------------------------------------------------------------------------

    def plan_chat(self, messages: list[dict], tools: list | None, kwargs: dict) -> Plan:
        """The prompt of a chat call with `messages` (template messages), continuing the earlier reply whose
        conversation its messages repeat when there is one."""
        context = (tools or None, kwargs)
        matches = [
            t
            for t in self.tips
            if t.kind == "chat"
            and t.context == context
            and len(t.key) < len(messages)
            and all(same_message(a, b) for a, b in zip(t.key, messages))
        ]
        if not matches:
            why = "its messages do not start with an earlier call's messages and the reply it got"
            return self._fresh(self.chat.prompt_ids(messages, tools, kwargs), why, context)
        tip = max(matches, key=lambda t: (len(t.key), t.length == t.trajectory.length))
        k = len(tip.key)
        try:
            inserted = self.chat.after(messages[:k], tip.model_turns, messages[k:], tools, kwargs, tip.stopped)
        except NotAPrefix as e:
            return self._fresh(self.chat.prompt_ids(messages, tools, kwargs), str(e), context)
        return Plan(tip.trajectory.tokens()[: tip.length] + inserted, tip, inserted, context=context)

    def plan_text(self, prompt: str | list[int], tokenizer) -> Plan:
        """The prompt of a /v1/completions call: text (or token ids) that starts with an earlier call's prompt and
        reply continues that reply's tokens, only the rest tokenised. The text a reply was returned as leaves out
        the end of its tokens (the end-of-turn token, a stop string): the prompt must repeat that end after it,
        as an agent that renders the next turn itself does, and the recorded tokens stand for it."""
        why = "its prompt does not start with an earlier call's prompt and the text it got"
        for tip in sorted((t for t in self.tips if t.kind == "text"), key=lambda t: -t.length):
            tokens = tip.trajectory.tokens()[: tip.length]
            if isinstance(prompt, list) and prompt[: len(tokens)] == tokens:
                return Plan(list(prompt), tip, list(prompt[len(tokens) :]))
            if isinstance(prompt, str) and tip.key is not None and prompt.startswith(tip.key):
                rest = prompt[len(tip.key) :]
                # the recorded tokens hold the reply's hidden end: the prompt stands for them only if it repeats it
                # (tokenising it again would put it in twice: `<|im_end|><|im_end|>`)
                if not rest.startswith(tip.hidden):
                    why = (
                        f"its prompt leaves out the end of the reply it continues ({tip.hidden!r}: sampled, but not "
                        "in the text returned); send it back right after that text"
                    )
                    continue
                rest = rest[len(tip.hidden) :]
                inserted = tokenizer(rest, add_special_tokens=False)["input_ids"] if rest else []
                return Plan(tokens + inserted, tip, inserted)
        ids = list(prompt) if isinstance(prompt, list) else tokenizer(prompt, add_special_tokens=False)["input_ids"]
        return self._fresh(ids, why)

    def _fresh(self, prompt_ids: list[int], why: str, context: tuple = ()) -> Plan:
        if not self.tips:  # the episode's first call
            return Plan(prompt_ids, context=context)
        if self.non_prefix == "refuse":
            self.fail("agent_non_prefix", f"a call was refused (agent.non_prefix: refuse): {why}")
            raise Refused("agent_non_prefix", f"episode {self.id}: {why} (agent.non_prefix: refuse)")
        return Plan(prompt_ids, split=why, context=context)

    # ---- after it generated ---------------------------------------------------------------------------------

    def record(self, plan: Plan, replies: list[Reply], kind: str, key: object) -> None:
        """Record a call's choices: the first continues the reply it was planned on, when no other call continued
        it meanwhile; every other choice starts a trajectory from the call's exact prompt tokens."""
        self.calls += 1
        self.splits += plan.split is not None
        for i, reply in enumerate(replies):
            if len(reply.completion.response_ids) == 0:
                continue
            tip = plan.tip
            if i == 0 and tip is not None and tip.length == tip.trajectory.length:
                trajectory = tip.trajectory
                trajectory.add_inserted(plan.inserted)
            else:
                self.forks += tip is not None
                trajectory = Trajectory(list(plan.prompt_ids))
                self.trajectories.append(trajectory)
            trajectory.add_reply(reply.completion)
            self.tips.append(self._tip(trajectory, reply, kind, key, plan.context, tip))
        if replies:
            self.final_text, self.final_finish = replies[0].text, replies[0].completion.finish_reason

    def _tip(self, trajectory: Trajectory, reply: Reply, kind: str, key: object, context: tuple, tip: Tip | None):
        if kind == "text":
            # what the tokens decode to, of which the agent got `reply.text`, its start: the rest is hidden
            produced = reply.raw + (self.chat.eos if reply.stopped else "")
            exact = key is not None and produced.startswith(reply.text)
            # a token-id prompt is continued by its ids only; text that is not the tokens' start (special tokens
            # skipped inside it) by its ids too, since no text the agent sends back stands for those tokens
            text = key + reply.text if exact else None
            hidden = produced[len(reply.text) :] if exact else ""
            return Tip(trajectory, trajectory.length, kind, text, stopped=reply.stopped, hidden=hidden)
        conversation = [*key, reply.message]
        model_turns = {len(key): reply.raw}
        if tip is not None:  # the earlier model turns of this conversation, where the continued reply had them
            model_turns = {**tip.model_turns, **model_turns}
        return Tip(trajectory, trajectory.length, kind, conversation, context, model_turns, reply.stopped)


def reply_of(completion: Completion, tokenizer, eos_ids: set[int], message: dict | None, text: str) -> Reply:
    """A choice as returned: `message`/`text` as the agent got them, and the model's own text for the template check."""
    ids = completion.response_ids.tolist()
    stopped = completion.finish_reason == "stop" and bool(ids) and ids[-1] in eos_ids
    raw = tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=False)
    return Reply(completion, message, text, raw, stopped)


def assistant_message(content: str | None, tool_calls: list[dict]) -> dict:
    """The template form of an assistant message returned to the agent."""
    return template_message({"role": "assistant", "content": content, "tool_calls": tool_calls}, "reply")


def trajectory_completion(t: Trajectory, prompt_len: int, tokenizer) -> Completion:
    """A trajectory as a Completion whose prompt is its first `prompt_len` tokens (the group's shared prompt); the
    tokens between that and its first sampled token are context, masked like the template's continuations."""
    lead = len(t.prompt_ids) - prompt_len
    tokens = t.tokens()
    ids = tokens[prompt_len:]
    env = [True] * lead + t.env
    fields = t.kept.fields()  # the leading context tokens have no kept set, as the template's tokens
    if "kept_offsets" in fields:
        fields["kept_offsets"] = torch.cat([torch.zeros(lead, dtype=torch.int32), fields["kept_offsets"]])
    first_version = t.versions[t.env.index(False)] if False in t.env else 0
    return Completion(
        prompt_ids=torch.tensor(tokens[:prompt_len], dtype=torch.long),
        response_ids=torch.tensor(ids, dtype=torch.long),
        logprobs=torch.tensor([0.0] * lead + t.logprobs, dtype=torch.float32),
        policy_versions=torch.tensor([first_version] * lead + t.versions, dtype=torch.long),
        finish_reason=t.finish_reason,
        text=tokenizer.decode([i for i, e in zip(ids, env) if not e], skip_special_tokens=True),
        env_mask=torch.tensor(env, dtype=torch.bool),
        sampling=t.sampling,
        **fields,
    )


def shared_prompt_len(trajectories: list[Trajectory]) -> int:
    """The longest prefix every trajectory's tokens share, up to the first sampled token of any of them: the
    prompt a group's completions have in common (forge_rl/types.py's Group holds one prompt)."""
    limit = min(len(t.prompt_ids) for t in trajectories)
    sequences = [t.tokens() for t in trajectories]
    n = 0
    while n < limit and all(s[n] == sequences[0][n] for s in sequences[1:]):
        n += 1
    return n
