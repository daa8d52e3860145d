"""A run's start-up, from a checked config to running actors: where each role runs, the generators' engine
arguments (on a GPU shared with the trainer, sized by the memory plan), every actor of the run, and the resume
from a checkpoint. `RLRun.start_roles` calls these in order; an algorithm's `start_beside` (PPO's critic) runs after
`start_actors`.

They read the run's settings and return what they made (the placement, the roles, the step resumed from); the run
keeps them, so a notebook that drives a run step by step sees the same objects the run uses (`run.roles`)."""

import asyncio
from dataclasses import replace
from pathlib import Path

from forge_rl.actors.dataset import PromptDataset
from forge_rl.actors.generator import Generator
from forge_rl.actors.reference import Reference
from forge_rl.actors.replay_buffer import ReplayBuffer
from forge_rl.actors.reward import RewardActor, judge_engine_args
from forge_rl.actors.reward_model import RewardModel
from forge_rl.actors.trainer import Trainer
from forge_rl.agents.factory import agent_entry
from forge_rl.agents.gateway_client import GatewayClient
from forge_rl.agents.gateways import Gateways
from forge_rl.agents.rollout import AgentRunner
from forge_rl.agents.server import AgentServer, EndpointSettings
from forge_rl.agents.workers import AgentWorkers
from forge_rl.launch.launcher import weight_server
from forge_rl.launch.launcher_config import LauncherConfig
from forge_rl.loop.checkpoint import resume_from_checkpoint
from forge_rl.loop.ranks import Ranks
from forge_rl.models import resolve_model_path
from forge_rl.recipes.grpo_checks import dp_size, max_prompt_tokens, model_len_and_room
from forge_rl.recipes.roles import Roles
from forge_rl.runtime.memory_plan import ModelShape, gpu_total_bytes, plan_memory
from forge_rl.runtime.vision_memory import tower_frozen
from forge_rl.runtime.placement import Placement, plan_placement, plan_reward_models
from forge_rl.runtime.provisioner import visible_gpus


def place(cfg, hosts: dict) -> tuple[Placement, int, list[str]]:
    """Where each role runs: (the placement, the GPUs of each generator replica, the GPUs the trainer's ranks
    take)."""
    tp = int(cfg.generator.engine_args.get("tensor_parallel_size", 1))
    if hosts:  # every role on hosts of its own: GPUs per node from the launcher, cores not pinned
        node_gpus = cfg.launcher.slurm.gpus_per_node or 0
        placement = host_placement(cfg.launcher, node_gpus)
        gpus = [str(i) for i in range(node_gpus)]
    else:
        gpus = visible_gpus()  # one GPU per trainer rank; a generator replica gets one per TP rank
        placement = plan_placement(cfg.resources, cfg.trainer_procs, cfg.generator.replicas, tp if gpus else 0, gpus)
        plan_reward_models(cfg.resources, placement, sum(r.model is not None for r in cfg.rewards))
    # a trainer that time-shares its GPU with an engine gives the step's cached memory back for its wake-up
    cfg.trainer.release_memory_after_step = placement.colocated and placement.device == "cuda"
    return placement, (tp if gpus else 0), gpus


def host_placement(launcher: LauncherConfig, node_gpus: int) -> Placement:
    """Roles on hosts of their own (a Slurm allocation): nothing to share, nothing to pin."""
    s = launcher.slurm
    where = f"{node_gpus} GPUs per node" if node_gpus else "CPU"
    return Placement(
        "disaggregated",
        "cuda" if node_gpus else "cpu",
        note=f"trainer on {s.trainer_nodes} node(s), generators on {s.generator_nodes} node(s), {where}",
    )


def on_trainer_procs(placement: Placement, gpus: list[str], procs: int) -> dict:
    """The actor options of a role on the trainer's `procs` (the trainer, the reference, PPO's critic): its ranks'
    cores and threads, and one GPU per rank as the placement planned them."""
    return dict(
        procs=procs,
        spmd=True,
        gpus=bool(gpus),
        host_mesh="trainer",
        cpus=_tuples(placement.trainer_cpus),
        threads=placement.trainer_threads,
        gpu_ids=_tuples([placement.trainer_gpus] if placement.trainer_gpus else []),
    )


async def start_actors(run, hosts: dict, gpus: list[str]) -> Roles:
    """The trainer, the generator replicas, the buffer, the reward and the dataset actors (and the reference
    when the run has one), each where the placement put it, with each trainer-like role's data shards."""
    cfg, placement = run.cfg, run.placement
    # Generators on other hosts than the trainer copy each version from the trainer's host (Monarch RDMA).
    weight_source = await weight_server(cfg.weight_store) if hosts else None
    shared = placement.colocated and placement.device == "cuda"
    trainer_procs = on_trainer_procs(placement, gpus, cfg.trainer_procs)
    reward_models = await start_reward_models(run)
    trainer, generator, buffer, reward, dataset = await asyncio.gather(
        Trainer.options(**dict(trainer_procs, share_gpus=shared)).as_actor(cfg.trainer, cfg.weight_store),
        Generator.options(
            replicas=cfg.generator.replicas,
            gpus=run.generator_gpus,
            share_gpus=shared,
            host_mesh="generator",
            cpus=_tuples(placement.generator_cpus),
            gpu_ids=_tuples(placement.generator_gpus),
        ).as_service(
            run.model_dir,
            engine_args=engine_args(run, shared),
            sampling=cfg.generator.sampling,
            seed=cfg.seed,
            swap_mode=cfg.generator.swap_mode,
            weight_store=cfg.weight_store,
            weight_source=weight_source,
            log_level=cfg.generator.log_level,
            lora=cfg.trainer.lora,
            max_kept_tokens=cfg.generator.max_kept_tokens,
            record_routes=cfg.trainer.keep_routing,  # Keep Routing: the trainer replays the engine's experts
        ),
        ReplayBuffer.as_actor(run.buffer_cfg, **run.buffer_run),
        RewardActor.as_actor(
            cfg.rewards, cfg.reward_timeout_s, cfg.reward_workers, cfg.reward_memory_mb, reward_models
        ),
        PromptDataset.as_actor(
            cfg.task, run.model_dir, cfg.seed, max_prompt_tokens(cfg, run.model_dir), cfg.chat_template_kwargs
        ),
    )
    roles = Roles(await Ranks.of(trainer), generator, buffer, reward, dataset)
    reference = run.algorithm.reference_model(cfg)
    if reference is not None:  # a frozen policy (or a teacher), on the trainer's cores
        reference = await Reference.options(**dict(trainer_procs, share_gpus=True)).as_actor(
            # the policy's routes replay in the policy's own model only, not in a distillation teacher's
            replace(
                cfg.trainer, model=reference, keep_routing=cfg.trainer.keep_routing and reference == cfg.trainer.model
            ),
            cfg.weight_store,
            weight_source,
        )
        roles = roles.with_role("reference", await Ranks.of(reference))
    return roles


async def start_agents(run, generator) -> AgentRunner | None:
    """The agent's OpenAI-compatible endpoint, served from a gateway process of its own in front of the run's
    generators (agent.gateway.process: false, from this process), and what plays its episodes: agent.workers
    worker processes, or (0) its function in this process; None without an agent."""
    cfg = run.cfg
    if not cfg.agent.enabled:
        return None
    settings = EndpointSettings(
        model_name=cfg.model,
        sampling=dict(cfg.generator.sampling),
        max_model_len=model_len_and_room(cfg, run.model_dir)[0],
        non_prefix=cfg.agent.non_prefix,
        port=cfg.agent.port,
        host=cfg.agent.gateway.host,
        tool_parser=cfg.agent.tool_parser,
        chat_template_kwargs=dict(cfg.chat_template_kwargs),
    )
    say = lambda line: run.console.print(line, markup=False, highlight=False)  # noqa: E731
    if cfg.agent.gateway.replicas > 1:
        server = Gateways(run.model_dir, settings, generator, run.tokenizer, say, cfg.agent.gateway.replicas)
    elif cfg.agent.gateway.process:
        server = GatewayClient(run.model_dir, settings, generator, run.tokenizer, say)
    else:
        server = AgentServer(run.tokenizer, generator, settings)
    await server.start()
    try:
        if cfg.agent.workers:  # the episodes played in worker processes of their own, off this one
            entry = await AgentWorkers(cfg.agent, cfg.model, server.run_key, run.log_dir, say).start()
        else:
            entry = agent_entry(cfg.agent, cfg.model)
    except BaseException:
        await server.stop()  # nothing of a start that failed is left running
        raise
    where = f"{cfg.agent.workers} agent workers" if cfg.agent.workers else "this process"
    served = "this process"
    if cfg.agent.gateway.process:
        pids = server.pids if isinstance(server, Gateways) else [server.pid]
        served = f"gateway process{'es' if len(pids) > 1 else ''}, pid {', '.join(map(str, pids))}"
    run.console.print(
        f"agent {cfg.agent.name} ({where}): OpenAI-compatible endpoint ({served}) at {server.base_url()} (each "
        f"episode's client: {server.base_url().removesuffix('/v1')}/episodes/<id>/v1)"
    )
    return AgentRunner(server, entry, cfg.agent.max_concurrent_episodes)


async def start_reward_models(run) -> dict:
    """Each reward model of `rewards` on procs of its own (forge_rl/actors/reward_model.py): a classifier's
    RewardModel actor, or a judge's vLLM Generator (greedy, one replica, on its own rewards[i].engine_args with
    TP 1, and no weight store: it serves its own checkpoint). Name -> actor, for the reward actor."""
    cfg, models = run.cfg, {}
    for spec in (s for s in cfg.rewards if s.model is not None):
        options = reward_model_options(run.placement, len(models))
        if spec.kind == "classifier":
            models[spec.name] = await RewardModel.options(mesh_name=f"RewardModel-{len(models)}", **options).as_actor(
                spec.model, spec.max_batch, spec.batch_window_ms
            )
        else:
            models[spec.name] = await Generator.options(mesh_name=f"Judge-{len(models)}", **options).as_actor(
                resolve_model_path(spec.model),
                engine_args=judge_engine_args(spec),
                sampling=dict(temperature=0.0, max_tokens=spec.max_tokens),
                seed=cfg.seed,
                policy_weights=False,
                log_level=cfg.generator.log_level,
                engine_args_key=f"rewards[{cfg.rewards.index(spec)}].engine_args",
            )
        run.console.print(f"reward model {spec.name} ({spec.kind}, {spec.model}) started")
    return models


def reward_model_options(placement: Placement, i: int) -> dict:
    """The i-th reward model's procs as the placement planned them (resources.reward_model_cpus / _gpus): its
    cores, or its GPU (time-shared, as another role may use it too). On a launcher's hosts: the controller's."""
    cpus, gpus = placement.reward_model_cpus, placement.reward_model_gpus
    if gpus:
        return dict(gpus=len(gpus[i]), gpu_ids=(tuple(gpus[i]),), share_gpus=True, host_mesh="reward_model")
    return dict(cpus=(tuple(cpus[i]),) if cpus else (), host_mesh="reward_model")


def engine_args(run, shared: bool) -> dict:
    """The generators' vLLM engine args. Colocated on GPUs: sleep mode (the engine sleeps while the trainer
    steps), and gpu_memory_utilization from the memory plan unless the user set it (then checked against it)."""
    args = dict(run.cfg.generator.engine_args)
    if not shared:
        return args
    args.setdefault("enable_sleep_mode", True)
    if (plan := memory_plan(run, args)) is not None:
        run.console.print(plan.describe())
        plan.check(args.get("gpu_memory_utilization"))  # a ConfigError with the numbers
        args.setdefault("gpu_memory_utilization", plan.gpu_memory_utilization)
    return args


def critic_parameters(model: str | None) -> int:
    """Parameters of a model trained beside the policy on the trainer's procs (PPO's critic), for the memory plan."""
    return ModelShape.from_config(resolve_model_path(model)).parameters() if model else 0


def memory_plan(run, engine_args: dict):
    """The plan of one colocated GPU (forge_rl/runtime/memory_plan.py); None when the model's config.json
    has no dense decoder's shape."""
    cfg = run.cfg
    try:
        shape = ModelShape.from_config(run.model_dir, name=Path(cfg.model).name)
        ref = run.algorithm.reference_model(cfg)
        ref_params = ModelShape.from_config(resolve_model_path(ref)).parameters() if ref else 0
    except (OSError, ValueError) as e:
        run.console.print(f"[yellow]no memory plan for the colocated GPUs: {e}[/yellow]")
        return None
    seq_len = engine_args.get("max_model_len") or shape.max_position_embeddings or 2048
    return plan_memory(
        shape,
        gpu_total_bytes(run.placement.gpus[0]),
        trainer_ranks=cfg.trainer_procs,
        micro_batch=cfg.trainer.micro_batch_size or -(-cfg.batch_groups * cfg.group_size // dp_size(cfg)),
        seq_len=seq_len,
        activation_checkpointing=cfg.trainer.parallel.activation_checkpointing,
        fused_lm_head=cfg.trainer.fused_lm_head,
        trainer_tp=cfg.trainer.parallel.tp,
        trainer_ep=cfg.trainer.parallel.ep,
        lora=cfg.trainer.lora.enabled,
        reference_params=ref_params,
        **({"lm_head_memory_gb": cfg.trainer.lm_head_memory_mb * 2**20 / 1e9} if cfg.trainer.lm_head_memory_mb else {}),
        critic_params=critic_parameters(run.algorithm.critic_model(cfg)),
        engine_dtype=engine_args.get("dtype", "bfloat16"),
        tensor_parallel_size=run.generator_gpus,
        max_model_len=engine_args.get("max_model_len"),
        max_num_seqs=engine_args.get("max_num_seqs"),
        vision_trained=not tower_frozen(cfg.trainer.freeze),
    )


async def resume(run, roles: Roles) -> int | None:
    """Continue from the checkpoint claim_output_dir chose and verified, if any: the step resumed at, or None."""
    path = run.claim.resume_from
    if path is None:
        return None
    step = await resume_from_checkpoint(
        run.state, roles.trainer.mesh, roles.generator, roles.buffer, roles.dataset, path, run.algorithm.others(roles)
    )
    run.console.print(
        f"resumed from {path} at step {step} (policy version {run.state.version}, run {run.claim.run_id})"
    )
    return step


def _tuples(lists: list[list[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(x) for x in lists)
