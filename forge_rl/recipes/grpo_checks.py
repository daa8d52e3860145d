"""The GRPO run's start-up checks: settings that only make sense together (errors name the keys), the task's data
against the rewards, prompt lengths against the engine, a mixture-of-experts model against the trainer settings;
and `derive_settings`, which fills in what follows from the other settings. Checks only check: they leave the
config as it was. The config itself is forge_rl/recipes/grpo_config.py."""

import json
import math
from pathlib import Path

from forge_rl.actors.generator_engine import route_engine_args
from forge_rl.actors.reward import check_reward_columns, reward_model_errors
from forge_rl.agents.entry import load_entry, require_openai
from forge_rl.agents.verifiers_env import load_environment, verifiers_task
from forge_rl.config import ConfigError
from forge_rl.data.task import TaskRows, check_prompts_fit, first_prompts
from forge_rl.deps.vllm import check_engine_args
from forge_rl.envs import env_factory
from forge_rl.errors import UserError
from forge_rl.loop.sampling import behaviour_temperature, check_sampling_values, truncation
from forge_rl.models import model_path
from forge_rl.recipes import run_config
from forge_rl.recipes.grpo_config import GRPOConfig
from forge_rl.rewards.reasoning_gym import task_rewards
from forge_rl.runtime.provisioner import visible_gpus


def check_config(cfg: GRPOConfig) -> None:
    """Settings that only make sense together; errors name the keys. The config is left as it was
    (derive_settings fills in what follows from it)."""
    check_sampling(cfg)
    check_engine_args(cfg.generator.engine_args, "generator.engine_args")  # before an engine start finds it
    logprobs_mode = cfg.generator.engine_args.get("logprobs_mode", "processed_logprobs")
    if logprobs_mode != "processed_logprobs":
        raise ConfigError(
            f"generator.engine_args.logprobs_mode={logprobs_mode!r}: behaviour logprobs must be of the "
            "sampled distribution (after temperature); use 'processed_logprobs'"
        )
    check_reference(cfg)
    if cfg.trainer.profile_steps and max(cfg.trainer.profile_steps) > cfg.steps:  # a window would never end
        raise ConfigError(
            f"trainer.profile_steps={list(cfg.trainer.profile_steps)} goes past the run's last step "
            f"(steps={cfg.steps}); profile steps 1 to {cfg.steps}"
        )
    if cfg.buffer.capacity < cfg.batch_groups:
        raise ConfigError(f"buffer.capacity={cfg.buffer.capacity} is smaller than batch_groups={cfg.batch_groups}")
    overlong = cfg.overlong.filter or cfg.overlong.penalty_cache_len
    if overlong and cfg.env.name is not None:
        key, value = (
            ("overlong.filter", cfg.overlong.filter)
            if cfg.overlong.filter
            else ("overlong.penalty_cache_len", cfg.overlong.penalty_cache_len)
        )
        raise ConfigError(
            f"{key}={value}: overlong.* applies to single-turn rollouts; with env.name set, limit trajectories "
            "with env.max_total_tokens"
        )
    if cfg.overlong.penalty_cache_len >= cfg.generator.sampling.get("max_tokens", 16):
        raise ConfigError(
            f"overlong.penalty_cache_len={cfg.overlong.penalty_cache_len} must be smaller than "
            f"generator.sampling.max_tokens={cfg.generator.sampling.get('max_tokens', 16)}"
        )
    check_single_turn_options(cfg)
    check_agent(cfg)
    if cfg.env.name is not None:
        environment(cfg)  # an unknown name or arguments fail here, naming env.name / env.args
    if cfg.launcher.kind == "slurm":
        check_slurm_sizes(cfg)
    for i, spec in enumerate(cfg.rewards):
        if spec.model is not None:  # a reward model's checkpoint must be there before any actor starts
            model_path(spec.model, f"rewards[{i}].model", role="judge" if spec.kind == "judge" else "reward model")
            check_engine_args(spec.engine_args, f"rewards[{i}].engine_args")
            if errors := reward_model_errors(spec):
                raise ConfigError("; ".join(f"rewards[{i}].{error}" for error in errors))
    names = [r.name for r in task_rewards(cfg)]  # a reasoning-gym task's scorer, where rewards are the default
    if cfg.task.eval_reward is not None and cfg.task.eval_reward not in names:
        raise ConfigError(f"task.eval_reward={cfg.task.eval_reward!r} is not one of the rewards {names}")


def settle_modes(cfg: GRPOConfig, zero_advantage_trains: str | None) -> list[str]:
    """Settings that another one overrides, set to agree with it; returns what was changed, for the console. A run
    whose groups of equal rewards still train (`zero_advantage_trains`: why) keeps them in the buffer; a synchronous
    loop trains only on the policy that generated (max_policy_age 0)."""
    changed = []
    if zero_advantage_trains and cfg.buffer.drop_zero_advantage:
        changed.append(f"buffer.drop_zero_advantage is turned off: {zero_advantage_trains}")
        cfg.buffer.drop_zero_advantage = False
    if not cfg.async_mode and cfg.max_policy_age != 0:
        changed.append("async_mode: false runs a synchronous loop; max_policy_age is set to 0")
        cfg.max_policy_age = 0
    return changed


def derive_settings(cfg: GRPOConfig) -> None:
    """Fill in the settings that follow from others (after check_config): the trainer's temperature (the
    behaviour policy's), its collective timeout (timeouts.collective_s), the dtype it publishes weights in (the
    engine's, unless set), Dr. GRPO's max_response_len (the generation budget, unless set), and the chat template
    arguments an environment needs (its tools; the user's own win), and a reasoning-gym task's scorer as the
    reward where `rewards` are left at their default."""
    cfg.rewards = task_rewards(cfg)
    cfg.trainer.temperature = behaviour_temperature(
        cfg.generator.sampling, max_kept_tokens=cfg.generator.max_kept_tokens
    )
    cfg.trainer.collective_timeout_s = cfg.timeouts.collective_s  # the trainer's process group
    if cfg.trainer.publish_dtype is None and cfg.generator.engine_args.get("dtype") in ("float32", "bfloat16"):
        cfg.trainer.publish_dtype = cfg.generator.engine_args["dtype"]  # push weights as the engine holds them
    if cfg.trainer.loss.normalize == "token_sum" and not cfg.trainer.loss.max_response_len:
        cfg.trainer.loss.max_response_len = response_budget(cfg)  # Dr. GRPO's constant: the generation budget
    if cfg.env.name is not None:
        cfg.chat_template_kwargs = {**environment(cfg).template_kwargs, **cfg.chat_template_kwargs}
    if cfg.agent.verifiers.env is not None:  # its taskset's rows, unless the config gives a task
        cfg.task = verifiers_task(cfg.task, cfg.agent.verifiers)


def environment(cfg: GRPOConfig) -> type:
    """The class env.name names, with env.args checked; a ConfigError naming the key otherwise."""
    try:
        return env_factory(cfg.env)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_single_turn_options(cfg: GRPOConfig) -> None:
    """generator.lengths and stale_in_flight "requeue" act on single-turn rollouts (one request per group)."""
    lengths = cfg.generator.lengths
    lengths.check(cfg.generator.sampling.get("max_tokens", 16))
    if lengths.enabled and (cfg.overlong.filter or cfg.overlong.penalty_cache_len):
        raise ConfigError(
            "generator.lengths draws every response's length (its tokens after the end are filler): "
            "overlong.* would judge the drawn lengths; turn one of them off"
        )
    for name, on in (
        ("generator.lengths", lengths.enabled),
        ("stale_in_flight=requeue", cfg.stale_in_flight == "requeue"),
    ):
        if on and cfg.env.name is not None:
            raise ConfigError(f"{name} applies to single-turn rollouts; env.name={cfg.env.name!r} is multi-turn")


def check_agent(cfg: GRPOConfig) -> None:
    """An agent (agent.entry, agent.command or a verifiers environment): the openai package installed, the agent
    loading before any engine starts, and no setting that the agent's episodes cannot honour."""
    if not cfg.agent.enabled:
        return
    require_openai()
    key, value = _agent_key(cfg)
    if cfg.agent.entry is not None:
        load_entry(cfg.agent.entry)
    elif cfg.agent.verifiers.env is not None:  # a verifiers environment: installed, found and loading
        load_environment(cfg.agent.verifiers)
    if cfg.env.name is not None:
        raise ConfigError(
            f"{key}={value!r} and env.name={cfg.env.name!r}: a run trains one task, an agent or an "
            "environment; set one of them to null"
        )
    refused = {
        "trainer.keep_routing=true": cfg.trainer.keep_routing,
        "generator.lengths": cfg.generator.lengths.enabled,
        "stale_in_flight=requeue": cfg.stale_in_flight == "requeue",
        "overlong.*": bool(cfg.overlong.filter or cfg.overlong.penalty_cache_len),
    }
    for name, on in refused.items():
        if on:
            raise ConfigError(
                f"{name} is not supported with {key} (it acts on one engine request per group, and an "
                "agent's episodes make their own calls); turn it off"
            )


def _agent_key(cfg: GRPOConfig) -> tuple[str, object]:
    """The agent setting the run was given, and its value, for a message."""
    for key, value in (
        ("agent.entry", cfg.agent.entry),
        ("agent.command", cfg.agent.command),
        ("agent.verifiers.env", cfg.agent.verifiers.env),
    ):
        if value is not None:
            return key, value
    return "agent.verifiers.env", None


def check_sampling(cfg: GRPOConfig) -> None:
    """The behaviour policy (generator.sampling): options the trainer reproduces, a temperature > 0 that the trainer
    takes, and room for at least one response token."""
    temperature = behaviour_temperature(cfg.generator.sampling, max_kept_tokens=cfg.generator.max_kept_tokens)
    max_logprobs, cap = cfg.generator.engine_args.get("max_logprobs"), cfg.generator.max_kept_tokens
    if truncation(cfg.generator.sampling) and max_logprobs not in (None, -1) and max_logprobs <= cap:
        raise ConfigError(
            f"generator.engine_args.max_logprobs={max_logprobs}: truncated sampling reads each token's "
            f"kept set from generator.max_kept_tokens + 1 = {cap + 1} logprobs; remove it (the "
            "generator sets it) or lower generator.max_kept_tokens"
        )
    if cfg.trainer.temperature is not None and cfg.trainer.temperature != temperature:
        raise ConfigError(
            f"trainer.temperature={cfg.trainer.temperature} differs from generator.sampling.temperature="
            f"{temperature}: the trainer must reproduce the sampling policy; set only generator.sampling.temperature"
        )
    max_tokens = cfg.generator.sampling.get("max_tokens", 16)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ConfigError(
            f"generator.sampling.max_tokens={max_tokens!r}: a response needs at least one token; give an integer >= 1"
        )
    check_sampling_values(cfg.generator.sampling)  # vLLM's own ranges, before an engine finds them


def check_group_size(cfg: GRPOConfig, algorithm: str) -> None:
    """For an advantage relative to the group (each reward minus its group's mean): one sample per prompt has
    advantage 0 always, and nothing would be learned (the buffer drops every such group)."""
    if cfg.group_size >= 2:
        return
    if cfg.trainer.loss.distill_coef > 0:
        raise ConfigError(
            f"group_size={cfg.group_size}: the reward's part of distillation's advantage "
            f"(trainer.loss.reward_coef={cfg.trainer.loss.reward_coef}) is relative to the group, so 0 "
            "with one sample per prompt; set group_size >= 2, or trainer.loss.reward_coef=0 to learn "
            "from the teacher alone"
        )
    raise ConfigError(
        f"group_size={cfg.group_size}: {algorithm}'s advantage is each reward minus its group's mean, "
        "0 with one sample per prompt, so nothing would be learned; set group_size >= 2 (e.g. 8), or "
        "use PPO (python -m apps.ppo.main), whose critic needs no group"
    )


def check_slurm_sizes(cfg: GRPOConfig) -> None:
    """Ranks and replicas must fit the nodes asked for: an allocation that cannot hold them fails after the queue."""
    s = cfg.launcher.slurm
    if cfg.trainer_procs % s.trainer_nodes:
        raise ConfigError(
            f"trainer_procs={cfg.trainer_procs} must spread evenly over launcher.slurm.trainer_nodes={s.trainer_nodes}"
        )
    if s.gpus_per_node:
        per_node = cfg.trainer_procs // s.trainer_nodes
        tp = int(cfg.generator.engine_args.get("tensor_parallel_size", 1))
        replicas_per_node = math.ceil(cfg.generator.replicas / s.generator_nodes)
        if per_node > s.gpus_per_node:
            raise ConfigError(
                f"trainer_procs={cfg.trainer_procs} over launcher.slurm.trainer_nodes={s.trainer_nodes} "
                f"is {per_node} ranks per node; launcher.slurm.gpus_per_node={s.gpus_per_node}"
            )
        if replicas_per_node * tp > s.gpus_per_node:
            raise ConfigError(
                f"generator.replicas={cfg.generator.replicas} x tensor_parallel_size={tp} on "
                f"launcher.slurm.generator_nodes={s.generator_nodes} needs {replicas_per_node * tp} GPUs "
                f"per node; launcher.slurm.gpus_per_node={s.gpus_per_node}"
            )


def check_task(cfg: GRPOConfig) -> TaskRows:
    """Read the task's data, its held-out set included, and match it to the rewards before any actor starts: a bad
    row or a missing column fails in seconds, naming the file, the row and the column. Returns the rows."""
    try:
        rows = TaskRows(cfg.task, cfg.seed)
        if cfg.eval_size:
            rows.held_out()
        if cfg.env.name is None:  # an environment scores trajectories itself
            check_reward_columns(cfg.rewards, rows.columns())
    except UserError:
        raise
    except ValueError as e:  # a reward that cannot be imported or does not fit the columns
        raise ConfigError(str(e)) from None
    return rows


def check_prompt_lengths(cfg: GRPOConfig, rows: TaskRows, tokenizer, model_dir: str) -> None:
    """Prompts too long for the engine are skipped one by one (and counted); a task where none fits is an error
    here, not an endless skip later, nor an evaluation of nothing."""
    model_len, room = model_len_and_room(cfg, model_dir)
    budget = "env.max_total_tokens" if cfg.env.name is not None else "generator.sampling.max_tokens"
    why = (
        f"the engine's max_model_len {model_len} minus {budget}={response_budget(cfg)}: raise "
        "generator.engine_args.max_model_len or shorten the prompts"
    )
    task, kwargs = rows.cfg, cfg.chat_template_kwargs
    check_prompts_fit(f"task.source {task.source!r}", first_prompts(rows), tokenizer, task, room, why, **kwargs)
    if cfg.eval_size:
        check_prompts_fit(
            f"task.held_out {task.held_out!r}", rows.held_out()[: cfg.eval_size], tokenizer, task, room, why, **kwargs
        )


def check_vision(cfg: GRPOConfig, model_dir: str) -> None:
    """A vision-language policy and the trainer settings its path does not take yet, and trainer.freeze naming a
    part the model has, before any actor starts."""
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    if "vision_config" in hf and (why := cfg.trainer.vision_refusal()):
        raise ConfigError(f"{why} ({cfg.model} is a vision-language model; docs/vision.md)")
    if cfg.trainer.freeze:  # the model built on the meta device: TorchTitan's import costs seconds, so only then
        from forge_rl.actors.train_model_build import parameter_names, unmatched_freeze

        if why := unmatched_freeze(parameter_names(model_dir), cfg.trainer.freeze):
            raise ConfigError(f"{why} ({cfg.model}); fix or remove the name")


def check_moe(cfg: GRPOConfig, model_dir: str) -> None:
    """A mixture-of-experts model (HF model_type qwen3_moe) and the trainer settings that depend on it, before any
    actor starts: no tensor parallelism over the experts, no LoRA (adapters on the grouped experts are not built),
    expert parallelism, Keep Routing and the load-balancing loss only on MoE, and over a divisor of the experts."""
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    moe = hf.get("model_type") == "qwen3_moe"
    ep = cfg.trainer.parallel.ep
    if moe and cfg.trainer.parallel.tp > 1:
        raise ConfigError(
            f"trainer.parallel.tp={cfg.trainer.parallel.tp}: tensor parallelism is not supported on a "
            f"mixture-of-experts model ({cfg.model}): forge_rl loads, computes and publishes the experts "
            "whole or split by expert only; set trainer.parallel.tp=1 and split them with "
            "trainer.parallel.ep"
        )
    if moe and cfg.trainer.lora.enabled:
        raise ConfigError(
            f"trainer.lora.rank={cfg.trainer.lora.rank}: LoRA is not supported on a mixture-of-experts "
            f"model ({cfg.model} is {hf.get('architectures', ['Qwen3-MoE'])[0]}); set trainer.lora.rank=0 "
            "(full fine-tuning, with trainer.parallel.ep for the experts)"
        )
    if cfg.trainer.keep_routing and not moe:
        raise ConfigError(
            f"trainer.keep_routing=true: Keep Routing replays the experts the engine chose, and "
            f"{cfg.model} is dense (model_type {hf.get('model_type')!r}); set trainer.keep_routing=false"
        )
    if cfg.trainer.keep_routing:  # the engine arguments the generators will refuse, refused before they start
        on_gpu = bool(cfg.launcher.slurm.gpus_per_node) if cfg.launcher.kind == "slurm" else bool(visible_gpus())
        route_engine_args(on_gpu, cfg.generator.engine_args, "generator.engine_args")
    if cfg.trainer.moe_aux_loss_coef and not moe:
        raise ConfigError(
            f"trainer.moe_aux_loss_coef={cfg.trainer.moe_aux_loss_coef}: a load-balancing loss needs "
            f"a mixture-of-experts model, and {cfg.model} is dense; set it to 0"
        )
    if ep < 1:
        raise ConfigError(f"trainer.parallel.ep={ep}: give the expert-parallel degree, >= 1")
    if ep > 1 and not moe:
        raise ConfigError(
            f"trainer.parallel.ep={ep}: expert parallelism needs a mixture-of-experts model, and "
            f"{cfg.model} is dense (model_type {hf.get('model_type')!r}); set trainer.parallel.ep=1"
        )
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    if ep > 1 and (experts % ep or cfg.trainer_procs % ep):
        raise ConfigError(
            f"trainer.parallel.ep={ep} must divide the model's {experts} experts and trainer_procs={cfg.trainer_procs}"
        )


def dp_size(cfg: GRPOConfig) -> int:
    """The trainer's data-parallel size, which must divide batch_groups (a group is never split over ranks)."""
    return run_config.dp_size(cfg, "batch_groups")


def response_budget(cfg: GRPOConfig) -> int:
    """Response tokens a trajectory may hold: the sampling's max_tokens, or env.max_total_tokens (multi-turn)."""
    return int(cfg.env.max_total_tokens if cfg.env.name is not None else cfg.generator.sampling.get("max_tokens", 16))


def max_prompt_tokens(cfg: GRPOConfig, model_dir: str) -> int:
    """Prompt tokens that leave room for max_tokens in the engine's max_model_len (default: the model's)."""
    return model_len_and_room(cfg, model_dir)[1]


def model_len_and_room(cfg: GRPOConfig, model_dir: str) -> tuple[int, int]:
    """The engine's max_model_len (default: the model's) and the prompt tokens it leaves beside a response."""
    limit = cfg.generator.engine_args.get("max_model_len")
    if limit is None:
        model_config = json.loads((Path(model_dir) / "config.json").read_text())
        limit = model_config["max_position_embeddings"]
    room = int(limit) - response_budget(cfg)
    if room < 1:
        raise ConfigError(
            f"generator.sampling.max_tokens={cfg.generator.sampling.get('max_tokens')} leaves no room "
            f"for a prompt in max_model_len={limit} (generator.engine_args.max_model_len)"
        )
    return int(limit), room


def check_reference(cfg: GRPOConfig) -> None:
    """reference.follow_every needs a reference, and a lag the weight store still holds after a publish."""
    r = cfg.reference
    if r.follow_every < 0 or r.follow_lag < 1:
        raise ConfigError(
            f"reference.follow_every={r.follow_every} must be >= 0 and reference.follow_lag={r.follow_lag} >= 1"
        )
    if not r.follow_every:
        return
    if not (cfg.trainer.loss.kl_coef or cfg.trainer.loss.distill_coef):
        raise ConfigError(
            f"reference.follow_every={r.follow_every} but the run has no reference policy: set "
            "trainer.loss.kl_coef > 0 (a KL to a moving anchor), or use apps/distill"
        )
    if r.follow_lag >= cfg.weight_store.keep_versions:
        raise ConfigError(
            f"reference.follow_lag={r.follow_lag}: the weight store keeps only the newest "
            f"{cfg.weight_store.keep_versions} versions (weight_store.keep_versions); set it to at "
            f"least {r.follow_lag + 1}"
        )
