"""The run's agent from its `agent` config: agent.entry's function, agent.command's program
(forge_rl/agents/command.py), or a verifiers environment's episodes (forge_rl/agents/verifiers_env.py), each run by
an AgentEntry (its client, its time limit, its result checked)."""

from forge_rl.agents.config import AgentConfig
from forge_rl.agents.entry import AgentEntry


def agent_entry(agent: AgentConfig, model: str, log_dir: str | None = None) -> AgentEntry:
    """The AgentEntry of the run's agent; `model` is the name its episodes call the endpoint's model by, `log_dir`
    where an agent.command program's stderr goes (None: the running run's log folder)."""
    if agent.entry is not None:
        return AgentEntry(agent.entry, agent.episode_timeout_s, agent.max_concurrent_episodes)
    if agent.command is not None:
        from forge_rl.agents.command import CommandAgent

        program = CommandAgent(agent.command, agent.max_output_bytes, log_dir)
        return AgentEntry(agent.name, agent.episode_timeout_s, agent.max_concurrent_episodes, fn=program)
    from forge_rl.agents.verifiers_env import VerifiersEpisodes, load_environment  # imports verifiers: seconds

    episodes = VerifiersEpisodes(load_environment(agent.verifiers, fresh=True), model)
    return AgentEntry(agent.name, agent.episode_timeout_s, agent.max_concurrent_episodes, fn=episodes)
