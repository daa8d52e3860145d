"""The no-vLLM GPU tier (`pytest -m gpu tests/gpu/test_gpu.py`, run by `make gpu-check`): the trainer's side of the GPU
path, importing nothing from vLLM, so that it runs on a host whose torch vLLM does not accept (a site PyTorch and a
wheelhouse install: docs/getting_started.md). The vLLM tier is tests/gpu/test_gpu_vllm.py.

On CUDA: a Qwen3-0.6B-shaped model (hidden 1024, 28 layers, the real 151,936-entry vocabulary), random weights,
built once per module: one FSDP2 bf16 step with fp32 master weights over NCCL, its peak GPU memory against the
memory plan, both publish paths from CUDA, the critic. Skipped where no GPU is visible, unless
FORGE_GPU_TIER_ON_CPU=1 (what `make gpu-check` sets there): then the same tests run on CPU (gloo) with a small
model of the same family, as a logic check of the same code, and no GPU figure is measured. Each test adds its
figures to `make gpu-check`'s table (the JSON-lines file FORGE_GPU_CHECK_REPORT names)."""

import json
import math
import os
import time

import pytest
import torch

from forge_rl.actors.trainer import Trainer
from forge_rl.actors.trainer_config import OptimizerConfig, TrainerConfig
from forge_rl.models.build_tiny import build
from forge_rl.types import TrainBatch

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

ON_CPU = not torch.cuda.is_available()  # only reached with FORGE_GPU_TIER_ON_CPU=1 (tests/conftest.py)
GPUS = 0 if ON_CPU else 1
QWEN3_0_6B_SHAPE = dict(
    hidden_size=1024,
    num_hidden_layers=28,
    intermediate_size=3072,
    vocab_size=151936,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
    torch_dtype="bfloat16",
)
SMALL_SHAPE = dict(
    QWEN3_0_6B_SHAPE,
    hidden_size=128,
    num_hidden_layers=2,
    intermediate_size=256,
    vocab_size=1024,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
)


# The small CPU model, 2026-11-26: grad norm 0.79 on-policy, 0.0008 with behaviour logprobs of -rand (ratio mean
# 0.002, 62% clipped; an H200's 0.6B-shaped step printed 0.000). A step that trains is far above this.
MIN_GRAD_NORM = 0.01


# Free parts of live segments after the critic's step, as a fraction of what is allocated: 141 MiB over 7.2 GB (2%)
# measured on an H200 (torch 2.11, 2026-11); the allocator splits cached segments for smaller tensors, so some
# always stays; more than this would be fragmentation worth looking at.
MAX_UNRELEASABLE_FRACTION = 0.05
FREED_AFTER_EMPTY_CACHE = 20 * 2**20  # one of the allocator's 20 MiB segments (for 1-10 MiB tensors)


def report(check: str, result: str) -> None:
    """A row of `make gpu-check`'s table (and the test's output)."""
    print(f"{check}: {result}")
    if path := os.environ.get("FORGE_GPU_CHECK_REPORT"):
        with open(path, "a") as f:
            f.write(json.dumps([check, result]) + "\n")


@pytest.fixture(scope="module")
def model_0_6b(tmp_path_factory):
    return build(tmp_path_factory.mktemp("qwen3-shape"), **(SMALL_SHAPE if ON_CPU else QWEN3_0_6B_SHAPE))


def _trainer_config(model_dir, tmp_path) -> TrainerConfig:
    return TrainerConfig(
        model=str(model_dir), dtype="bfloat16", optim=OptimizerConfig(lr=1e-5), checkpoint_dir=str(tmp_path / "ckpt")
    )


def test_fsdp2_bf16_train_step_over_nccl_and_its_peak_memory_against_the_plan(loop, model_0_6b, tmp_path):
    """One bf16 step with fp32 masters (FSDP2, the trainer's "cpu:gloo,cuda:nccl" group) that trains: the batch's
    behaviour logprobs are the model's own (on-policy: ratio 1, nothing clipped), so every response token carries
    its advantage's gradient. Its peak GPU memory (the caching allocator's) within what the memory plan predicts for
    this step plus the plan's margin."""
    from forge_rl.runtime import stop_actor
    from forge_rl.runtime.memory_plan import MARGIN_GB, ModelShape, plan_memory
    from tests.support.actors import CudaMemory

    trainer = loop.run_until_complete(
        Trainer.options(procs=1, spmd=True, gpus=GPUS, share_gpus=True).as_actor(_trainer_config(model_0_6b, tmp_path))
    )
    try:
        g = torch.Generator().manual_seed(0)
        rows, seq = 8, 256
        tokens = torch.randint(3, 128, (rows, seq), generator=g)
        mask = torch.zeros_like(tokens, dtype=torch.bool)
        mask[:, 64:] = True
        advantages = torch.randn(rows, generator=g)
        # Behaviour logprobs far from the model's (a random-weight model gives about -ln V = -11.9 per token, and
        # -rand was in [-1, 0]) make every ratio ~e^-11: clipped or vanishing, grad norm ~0. The model's own are
        # what an on-policy sample would carry.
        probe = TrainBatch(tokens, mask, torch.zeros(rows, seq), torch.where(mask, 0, -1), advantages)
        behaviour = loop.run_until_complete(trainer.logprobs.call(probe)).get(0).float() * mask
        batch = TrainBatch(tokens, mask, behaviour, torch.where(mask, 0, -1), advantages)
        metrics = loop.run_until_complete(trainer.step.call([batch])).get(0)
        assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])
        assert metrics["skipped"] == 0.0
        assert metrics["clip_fraction"] == 0.0 and metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-3), metrics
        assert metrics["grad_norm"] >= MIN_GRAD_NORM, metrics
        peak = (
            None
            if ON_CPU
            else loop.run_until_complete(trainer._forge_proc_mesh.spawn("cuda_memory", CudaMemory).read.call_one())[
                "max_reserved"
            ]
        )
    finally:
        loop.run_until_complete(stop_actor(trainer))
    gpu_bytes = 80e9 if ON_CPU else torch.cuda.get_device_properties(0).total_memory
    plan = plan_memory(
        ModelShape.from_config(model_0_6b),
        gpu_bytes,
        micro_batch=rows,
        seq_len=seq,
        activation_checkpointing=False,
        max_model_len=seq,
    )
    predicted = plan.trainer_step_gb + plan.activations_gb
    report(
        "no-vLLM: bf16 train step",
        f"{'gloo (CPU)' if ON_CPU else 'NCCL'}, {plan.params / 1e6:.1f}M params, "
        f"{rows} x {seq} tokens, on-policy: loss {metrics['loss']:.4f}, grad norm "
        f"{metrics['grad_norm']:.3f} (at least {MIN_GRAD_NORM}), ratio mean "
        f"{metrics['ratio_mean']:.4f}, clipped {metrics['clip_fraction']:.0%}",
    )
    measured = "not measured (no CUDA)" if peak is None else f"{peak / 1e9:.2f} GB (max reserved)"
    report(
        "no-vLLM: peak memory vs plan",
        f"{measured}; plan {predicted:.2f} GB = states {plan.trainer_step_gb:.2f}"
        f" (CUDA context 1.0 included) + activations {plan.activations_gb:.2f}, "
        f"margin {MARGIN_GB:.1f}",
    )
    if peak is not None:
        assert peak / 1e9 <= predicted + MARGIN_GB, (peak, plan.describe())


def test_both_publish_paths_copy_cuda_weights_into_shared_memory_bit_exact(loop, model_0_6b, tmp_path):
    """fp32 masters on the GPU published in bf16 by shard writes and from rank 0 (as ranks on several hosts do):
    each tensor, or block of rows, is converted on the device and copied straight into the version's shared
    memory; both give back the checkpoint the masters were loaded from, rounded to bf16, bit-exact. Three versions
    from each trainer, timed: the first into fresh pages, the second into a spare file its process prepared after
    the first (while a run's trainer steps), the third into the first's pages, recycled (keep_versions=2)."""
    from forge_rl.runtime import stop_actor
    from forge_rl.weights import ShmWeightStore, WeightStoreConfig

    run_store = ShmWeightStore()  # the run's shared memory (removed with the run): one folder in it per path
    try:
        for publish_from in ("auto", "rank0"):
            cfg = _trainer_config(model_0_6b, tmp_path / publish_from)
            cfg.publish_from, cfg.publish_block_mb = publish_from, 16.0
            store_cfg = WeightStoreConfig(root=str(run_store.root / publish_from))
            trainer = loop.run_until_complete(
                Trainer.options(procs=1, spmd=True, gpus=GPUS, share_gpus=True).as_actor(cfg, store_cfg)
            )
            store = ShmWeightStore(cfg=store_cfg)
            try:
                took, record = _publish_three_versions(loop, trainer, store, model_0_6b, publish_from)
            finally:
                loop.run_until_complete(stop_actor(trainer))
                store.close()
            if publish_from == "rank0":
                assert 0 < record["largest_held_bytes"] <= 16 * 2**20
            report(
                f"no-vLLM: publish ({'shard writes' if publish_from == 'auto' else 'rank-0 stream'})",
                f"{'CPU' if ON_CPU else 'CUDA'} -> shm, {record['bytes'] / 1e6:.1f} MB bf16, bit-exact: first "
                f"{took[0]:.2f} s (fresh pages), second {took[1]:.2f} s (a spare prepared after the first), "
                f"third {took[2]:.2f} s (the first's pages again)"
                + (
                    f"; largest block held {record['largest_held_bytes'] / 2**20:.1f} MiB"
                    if publish_from == "rank0"
                    else ""
                ),
            )
    finally:
        run_store.close()


def _publish_three_versions(loop, trainer, store, model_dir, publish_from: str) -> tuple[list[float], dict]:
    """Versions 1-3 from `trainer`, read back through `store` (a reader on the same folder): the times of the
    three pushes and the last push's record. Version 1 must be the checkpoint in bf16, bit-exact; version 2 takes
    the spare prepared after version 1 and version 3 version 1's file."""
    from safetensors.torch import load_file

    from forge_rl.weights import spares

    want = {}  # the checkpoint is fp32 (build saves fp32): the masters load it exactly, publish rounds it to bf16
    for file in sorted(model_dir.glob("*.safetensors")):
        want |= {name: t.to(torch.bfloat16) for name, t in load_file(file).items()}
    took, inodes = [], {}
    for version in (1, 2, 3):
        if version == 2:  # a run's trainer steps meanwhile: here, the spare is waited for
            deadline = time.monotonic() + 120
            while not spares.ready(store.root) and time.monotonic() < deadline:
                time.sleep(0.05)
            (spare,) = spares.ready(store.root)
            inodes["spare"] = spare.stat().st_ino
        start = time.perf_counter()
        record = loop.run_until_complete(trainer.push_weights.call(version)).get(0)
        took.append(time.perf_counter() - start)
        inodes[version] = (store.path(version) / "model.safetensors").stat().st_ino
        if version == 1:
            got = store.load(version)
            assert set(want) <= set(got), sorted(set(want) - set(got))[:3]
            for name, tensor in want.items():
                assert torch.equal(got[name], tensor), (publish_from, name)
            assert torch.equal(got["lm_head.weight"], want["model.embed_tokens.weight"])  # tied
            del got  # unpinned: version 3 may recycle its pages
    assert inodes[2] == inodes["spare"] and inodes[3] == inodes[1], inodes
    assert all(torch.equal(t, want[name]) for name, t in store.load(3).items() if name in want)
    return took, record


def test_critic_steps_on_the_gpu_and_gives_its_cached_memory_back(loop, model_0_6b, tmp_path):
    """The critic time-sharing a GPU (release_memory_after_step, as a colocated PPO run sets it): a bf16 value step
    of the 0.6B-shaped model with fp32 masters, after which its caching allocator keeps little more than what it
    cannot give back: the free parts of segments that still hold a live tensor (the allocator returns whole segments
    only; torch counts those parts as inactive_split_bytes). The step's activations went back to the device for the
    engine to wake into."""
    from forge_rl.actors.critic import Critic
    from forge_rl.runtime import stop_actor
    from tests.support.actors import CudaMemory
    from tests.integration.test_critic import valued
    from tests.integration.test_trainer import make_batch

    cfg = _trainer_config(model_0_6b, tmp_path)
    cfg.release_memory_after_step = True
    critic = loop.run_until_complete(
        Critic.options(procs=1, spmd=True, gpus=GPUS, share_gpus=True).as_actor(cfg, value_clip=0.2, epochs=1)
    )
    try:
        batches = valued(loop, critic, [make_batch(0)])
        metrics = loop.run_until_complete(critic.step.call(batches)).get(0)
        assert math.isfinite(metrics["value_loss"]) and metrics["grad_norm"] > 0 and metrics["step"] == 1
        if ON_CPU:
            report(
                "no-vLLM: critic",
                f"value step on CPU: value loss {metrics['value_loss']:.4f}; GPU memory not measured (no CUDA)",
            )
            return
        after = loop.run_until_complete(critic._forge_proc_mesh.spawn("cuda_memory", CudaMemory).read.call_one())
        cached = after["reserved"] - after["allocated"]
        report(
            "no-vLLM: critic",
            f"value loss {metrics['value_loss']:.4f}; peak reserved "
            f"{after['max_reserved'] / 2**30:.2f} GiB, after the step reserved "
            f"{after['reserved'] / 2**30:.2f} GiB for {after['allocated'] / 2**30:.2f} GiB "
            f"allocated: {cached / 2**20:.0f} MiB cached, of which "
            f"{after['non_releasable'] / 2**20:.0f} MiB in segments a live tensor holds",
        )
        # Given back: what is still cached is what no empty_cache can return (an H200, torch 2.11: 141 MiB over 7.2
        # GB allocated), but for whole segments freed after the step's empty_cache by its last micro-batch's tensors
        # (KBs here: a few 2 MiB small-pool segments at most). Not given back, the step's activations (GBs) would be.
        assert cached - after["non_releasable"] <= FREED_AFTER_EMPTY_CACHE, after
        assert cached <= MAX_UNRELEASABLE_FRACTION * after["allocated"], after
        assert after["max_reserved"] > after["reserved"]
    finally:
        loop.run_until_complete(stop_actor(critic))


def test_a_classifier_reward_model_scores_in_bf16_on_the_gpu(loop, tmp_path):
    """A one-label classifier reward model placed on a GPU loads in bf16 and scores a group as transformers does in
    fp32, to bf16's rounding, ranking the group's completions as fp32 does."""
    from forge_rl.actors.reward_model import RewardModel
    from forge_rl.runtime import stop_actor
    from tests.integration.test_reward_model import ANSWERS, QUESTIONS, make_classifier, transformers_scores

    path = make_classifier(tmp_path / "tiny_rm")
    rm = loop.run_until_complete(RewardModel.options(gpus=GPUS, share_gpus=True).as_actor(str(path), 64, 10.0))
    try:
        got = loop.run_until_complete(rm.score.call_one([QUESTIONS[0]] * 3, ANSWERS[0]))
        want = transformers_scores(path, [QUESTIONS[0]] * 3, ANSWERS[0])
        # bf16's error through a random model is absolute, about the same for every score (an H200: 0.05-0.23 on
        # scores spanning -3 to 12.5), so it is bounded by the scores' scale; and the group is ranked as in fp32,
        # which is what GRPO's per-group advantages read
        assert got == pytest.approx(want, abs=0.03 * max(abs(w) for w in want))
        assert sorted(range(3), key=got.__getitem__) == sorted(range(3), key=want.__getitem__)
        assert len({round(v, 2) for v in got}) > 1  # it tells the completions apart
    finally:
        loop.run_until_complete(stop_actor(rm))


def test_bf16_step_on_cuda_runs_every_norm_and_matmul_in_bf16_and_reports_its_mfu():
    """On the GPU, the trainer's step code under bf16 autocast over fp32 masters (one rank, no FSDP2): every
    rms_norm meets a weight of its input's dtype (the fused kernel), every matmul, the head's included, is bf16 x bf16
    (tensor cores); the device's peak for MFU is its datasheet's where the table knows it."""
    from forge_rl.observability.mfu import device_peak_flops, measured_matmul_flops
    from tests.support.precision import bf16_step_dtypes, group_batch, trainer_step

    step = trainer_step("bfloat16", share_prompts=True, device="cuda" if not ON_CPU else "cpu")
    norms, matmuls = bf16_step_dtypes(step, *group_batch())
    fp32 = {(dtypes, cols) for dtypes, cols in matmuls if dtypes != (torch.bfloat16, torch.bfloat16)}
    assert norms and all(x == w for x, w in norms), set(norms)
    assert not fp32, fp32
    peak, source = device_peak_flops(step.device)
    measured = measured_matmul_flops(step.device)
    report(
        "no-vLLM: bf16 dtypes and the MFU peak",
        f"every norm and matmul bf16; a bf16 matmul at {measured / 1e12:.3g} of {peak / 1e12:.3g} TFLOP/s ({source})",
    )
    assert measured <= 1.1 * peak or source == "measured"
