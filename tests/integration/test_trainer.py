"""Trainer actor on the tiny model: FSDP2/TP parity with one proc, checkpoints, export, bad input."""

import asyncio
import math
import os
import signal
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from monarch.actor import ActorError

from forge_rl.actors.trainer import Trainer
from forge_rl.actors.trainer_config import OptimizerConfig, ParallelConfig, TrainerConfig
from forge_rl.types import TrainBatch
from tests.support.actors import Echo
from tests.conftest import TINY_MODEL, small_tmpfs


def make_batch(seed: int, B: int = 8, T: int = 24, shared_prompt: int = 0) -> TrainBatch:
    """Random rows; with `shared_prompt` = P, every row has the same P-token prompt (one GRPO group)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 128, (B, T), generator=g)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[:, shared_prompt or 10 :] = True
    tokens[:, :shared_prompt] = tokens[0, :shared_prompt]
    mask[0, 20:] = False  # one shorter response: the normalisations must see unequal lengths
    behaviour = -torch.rand(B, T, generator=g) * 5 * mask
    return TrainBatch(tokens, mask, behaviour, torch.where(mask, 0, -1), torch.randn(B, generator=g))


def split(batch: TrainBatch, n: int) -> list[TrainBatch]:
    return [
        TrainBatch(
            batch.tokens[i::n],
            batch.response_mask[i::n],
            batch.behaviour_logprobs[i::n],
            batch.policy_versions[i::n],
            batch.advantages[i::n],
        )
        for i in range(n)
    ]


def config(tmp_path, **parallel) -> TrainerConfig:
    return TrainerConfig(
        model="tiny",
        parallel=ParallelConfig(**parallel),
        optim=OptimizerConfig(lr=1e-3),
        checkpoint_dir=str(tmp_path / "ckpt"),
    )


def spawn(loop, cfg: TrainerConfig, procs: int = 1):
    return loop.run_until_complete(Trainer.options(procs=procs, spmd=True).as_actor(cfg))


def steps(loop, trainer, n_dp: int, seeds=(0, 1, 2), shared_prompt: int = 0) -> list[dict]:
    return [
        loop.run_until_complete(trainer.step.call(split(make_batch(s, shared_prompt=shared_prompt), n_dp))).item(
            procs=0
        )
        for s in seeds
    ]


@pytest.fixture(scope="module")
def single(loop, tmp_path_factory):
    """One-proc trainer shared by the tests that do not need a fresh model; it profiles its first step."""
    folder = tmp_path_factory.mktemp("single")
    return spawn(loop, replace(config(folder), profile_steps=[1], profile_dir=str(folder / "profile")))


def test_fsdp_and_tp_match_one_proc(loop, tmp_path):
    """Random rows, then rows of one shared prompt: the one-proc trainer runs every row whole
    (share_prompts off); FSDP2 and TP pack the shared prompt, and must still match it."""
    from forge_rl.runtime import stop_actor

    reference = spawn(loop, unpacked(config(tmp_path / "one")))
    expected = steps(loop, reference, 1) + steps(loop, reference, 1, seeds=(3, 4), shared_prompt=16)
    loop.run_until_complete(stop_actor(reference))
    fsdp = spawn(loop, replace_mb(config(tmp_path / "fsdp", dp_shard=2), 2), procs=2)  # and 2 micro-batches
    # every batch to every rank, then (as the run sends them) each rank its own batch and the other's counts
    got_fsdp = steps(loop, fsdp, 2) + steps_per_rank(loop, fsdp, 2, seeds=(3, 4), shared_prompt=16)
    read_by_rank(loop, fsdp, 2)
    one_rank_rejects_its_batch(loop, fsdp)
    loop.run_until_complete(stop_actor(fsdp))
    tp = spawn(loop, config(tmp_path / "tp", dp_shard=1, tp=2), procs=2)
    got_tp = steps(loop, tp, 1) + steps(loop, tp, 1, seeds=(3, 4), shared_prompt=16)
    read_by_rank(loop, tp, 2)
    loop.run_until_complete(stop_actor(tp))
    for got in (got_fsdp, got_tp):
        for e, g in zip(expected, got):
            assert abs(e["loss"] - g["loss"]) < 1e-5 and abs(e["grad_norm"] - g["grad_norm"]) < 1e-4
            assert abs(e["entropy"] - g["entropy"]) < 1e-5
        assert [g["model_tokens"] < g["tokens"] for g in got] == [False] * 3 + [True] * 2  # packed: fewer tokens
    assert all(e["model_tokens"] == e["tokens"] for e in expected)
    # TP computes logprobs from its vocabulary shards (loss parallel); the others hold whole logits
    assert [g["loss_parallel"] for g in expected + got_fsdp + got_tp] == [0.0] * 10 + [1.0] * 5
    assert expected[0]["loss"] != expected[2]["loss"] and 0 < expected[0]["clip_fraction"] < 1


async def each_rank(calls) -> list:
    return list(await asyncio.gather(*calls))


def steps_per_rank(loop, trainer, n_dp: int, seeds, shared_prompt: int = 0) -> list[dict]:
    from forge_rl.loop.ranks import Ranks
    from forge_rl.runtime.message_bytes import message_bytes, sent_bytes

    ranks = loop.run_until_complete(Ranks.of(trainer))
    shards = ranks.shards
    assert sorted(set(shards)) == list(range(n_dp))
    out = []
    for s in seeds:
        batches = split(make_batch(s, shared_prompt=shared_prompt), n_dp)
        sent = ranks.sending(batches)
        assert all(sum(isinstance(b, TrainBatch) for b in rank_batches) == 1 for _, rank_batches in sent)  # its own
        with sent_bytes() as wire:  # what the controller serialised for the ranks, one message each
            out.append(loop.run_until_complete(each_rank(rank.step.call_one(b) for rank, b in sent))[0])
        # each batch once (its message), and to the other ranks its counts; every batch to every rank was
        # world x message_bytes(batches)
        each_once = sum(message_bytes([b]) for b in batches)
        counts = sum(message_bytes(b.shape_only()) for b in batches)
        tensors = sum(t.nbytes for b in batches for t in (b.tokens, b.response_mask, b.behaviour_logprobs))
        assert len(wire.calls) == len(shards) and tensors < wire.total <= each_once + (n_dp - 1) * counts, wire
        assert wire.total < len(shards) * message_bytes(batches) * 0.6, wire
    return out


def one_rank_rejects_its_batch(loop, trainer) -> None:
    """Rank 1's batch is malformed and only rank 1 sees it: both ranks raise (neither waits in a collective for
    the other) and nothing changes."""
    from forge_rl.loop.ranks import Ranks

    version = loop.run_until_complete(trainer.version.call()).item(procs=0)
    batches = split(make_batch(7), 2)
    batches[1].advantages[0] = float("nan")
    sent = loop.run_until_complete(Ranks.of(trainer)).sending(batches)

    async def both():  # each rank's call on its own, so one's error does not hide the other's
        return await asyncio.gather(*(rank.step.call_one(b) for rank, b in sent), return_exceptions=True)

    results = loop.run_until_complete(asyncio.wait_for(both(), 60))
    assert "another trainer rank rejected its batch" in str(results[0])
    assert "batch[1].advantages has nan" in str(results[1])
    assert loop.run_until_complete(trainer.version.call()).item(procs=1) == version


def read_by_rank(loop, trainer, procs: int) -> None:
    """Each rank read only its shards of the checkpoint: at most 1/procs of it plus one tensor (the bound
    that lets a 32B checkpoint load on 32 ranks), never the whole as every rank used to."""
    stats = loop.run_until_complete(trainer.load_stats.call())
    for rank in range(procs):
        s = stats.item(procs=rank)
        assert s["bytes_read"] <= s["checkpoint_bytes"] / procs + s["largest_read"], s
        assert s["bytes_read"] < 0.75 * s["checkpoint_bytes"], s


def unpacked(cfg: TrainerConfig) -> TrainerConfig:
    cfg.share_prompts = False
    return cfg


def replace_mb(cfg: TrainerConfig, micro_batch_size: int) -> TrainerConfig:
    cfg.micro_batch_size = micro_batch_size
    return cfg


def malformed(change) -> TrainBatch:
    """make_batch(1) (8 rows of 24 tokens) with one thing wrong."""
    b = make_batch(1)
    change(b)
    return b


def _set(**fields):
    """Replace fields: by a value, or by a function of the batch."""

    def change(b: TrainBatch) -> None:
        for name, value in fields.items():
            setattr(b, name, value(b) if callable(value) else value)

    return change


def _poke(field: str, at: tuple, value):
    return lambda b: getattr(b, field).__setitem__(at, value)


# (one rank's batch with something wrong, what the error must say)
MALFORMED = {
    "short logprobs": (
        _set(behaviour_logprobs=lambda b: b.behaviour_logprobs[:, :-1]),
        r"batch\[0\]\.behaviour_logprobs has shape \(8, 23\), expected \(8, 24\) "
        r"\(tokens is \(8, 24\)\)",
    ),
    "mask rows": (
        _set(response_mask=lambda b: b.response_mask[:7]),
        r"batch\[0\]\.response_mask has shape \(7, 24\), expected \(8, 24\)",
    ),
    "versions shape": (
        _set(policy_versions=lambda b: b.policy_versions.T),
        r"batch\[0\]\.policy_versions has shape \(24, 8\), expected \(8, 24\)",
    ),
    "advantages shape": (
        _set(advantages=lambda b: b.advantages[:, None]),
        r"batch\[0\]\.advantages has shape \(8, 1\), expected \(8,\) \(one per sequence\)",
    ),
    "ref shape": (
        _set(ref_logprobs=torch.zeros(8, 25)),
        r"batch\[0\]\.ref_logprobs has shape \(8, 25\), expected \(8, 24\)",
    ),
    "1-D tokens": (
        _set(tokens=lambda b: b.tokens.flatten()),
        r"batch\[0\]\.tokens has shape \(192,\), expected 2 dims",
    ),
    "float tokens": (
        _set(tokens=lambda b: b.tokens.float()),
        r"batch\[0\]\.tokens has dtype torch.float32, expected torch.int64",
    ),
    "uint8 mask": (
        _set(response_mask=lambda b: b.response_mask.to(torch.uint8)),
        r"batch\[0\]\.response_mask has dtype torch.uint8, expected torch.bool",
    ),
    "float64 logprobs": (
        _set(behaviour_logprobs=lambda b: b.behaviour_logprobs.double()),
        r"batch\[0\]\.behaviour_logprobs has dtype torch.float64, expected torch.float32",
    ),
    "bf16 advantages": (
        _set(advantages=lambda b: b.advantages.bfloat16()),
        r"batch\[0\]\.advantages has dtype torch.bfloat16, expected torch.float32",
    ),
    "list advantages": (
        _set(advantages=[0.5] * 8),
        r"batch\[0\]\.advantages is a list, expected a torch.float32 tensor",
    ),
    "nan advantage": (
        _poke("advantages", (3,), float("nan")),
        r"batch\[0\]\.advantages has nan at \[3\] \(1 non-finite values\), expected finite values",
    ),
    "inf logprob": (
        _poke("behaviour_logprobs", (2, 15), float("-inf")),
        r"batch\[0\]\.behaviour_logprobs has -inf at \[2, 15\]",
    ),
    # outside the response too: the loss masks by multiplying, and NaN * 0 is NaN
    "nan prompt logprob": (
        _poke("behaviour_logprobs", (1, 0), float("nan")),
        r"batch\[0\]\.behaviour_logprobs has nan at \[1, 0\]",
    ),
    "nan ref": (
        _set(ref_logprobs=lambda b: torch.full((8, 24), float("nan"))),
        r"batch\[0\]\.ref_logprobs has nan at \[0, 0\] \(192 non-finite values\)",
    ),
    "id = vocab": (
        _poke("tokens", (5, 7), 128),
        r"batch\[0\]\.tokens has id 128 at \[5, 7\] \(1 such ids\), "
        r"outside the model's vocabulary \[0, 128\)",
    ),
    "negative id": (_poke("tokens", (0, 0), -1), r"batch\[0\]\.tokens has id -1 at \[0, 0\]"),
    "no rows": (
        _set(tokens=lambda b: b.tokens[:0], response_mask=lambda b: b.response_mask[:0]),
        r"batch\[0\] is empty: tokens has shape \(0, 24\), expected at least one sequence",
    ),
    "no response": (lambda b: b.response_mask.fill_(False), r"batch\[0\] has no response tokens"),
    "too long": (
        _set(tokens=torch.ones(8, 600, dtype=torch.long)),
        r"sequences of 600 tokens; the model's max_seq_len is 512",
    ),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_batches_name_the_field_expected_and_actual(case):
    from forge_rl.actors.batch_checks import validate_batches

    change, message = MALFORMED[case]
    with pytest.raises(ValueError, match=message):
        validate_batches([malformed(change)], 1, vocab_size=128, max_len=512)
    with pytest.raises(ValueError, match=message.replace(r"batch\[0\]", r"batch\[1\]")):  # the rank is named
        validate_batches([make_batch(0), malformed(change)], 2, vocab_size=128, max_len=512)
    validate_batches([make_batch(0)], 1, vocab_size=128, max_len=512)  # and the well-formed batch passes


def test_bad_batches_are_rejected_before_any_change(loop, single):
    """Through the endpoint (so across Monarch's pickling): every kind of bad input is refused, and the
    trainer is exactly as before: same weights (logprobs of a probe), same step; the next good step is
    its first one."""
    probe = make_batch(9)
    before = loop.run_until_complete(single.logprobs.call_one(probe))
    cases = [
        ([malformed(MALFORMED[c][0])], MALFORMED[c][1])
        for c in (
            "short logprobs",
            "float tokens",
            "nan advantage",
            "inf logprob",
            "id = vocab",
            "no rows",
            "no response",
        )
    ]
    cases += [
        ([make_batch(1)] * 2, r"one TrainBatch per data-parallel rank \(1\), got 2"),
        ([], r"one TrainBatch per data-parallel rank \(1\), got 0"),
        ([{"tokens": make_batch(1).tokens}], r"batch\[0\] is a dict, expected a TrainBatch"),
    ]
    for batches, message in cases:
        with pytest.raises(ActorError, match=message):
            loop.run_until_complete(single.step.call_one(batches))
    after = loop.run_until_complete(single.logprobs.call_one(probe))
    assert torch.equal(before, after) and loop.run_until_complete(single.version.call_one()) == 0
    m = loop.run_until_complete(single.step.call_one([make_batch(0)]))
    assert m["step"] == 1 and m["skipped"] == 0 and m["lr"] == 1e-3 and math.isfinite(m["loss"])
    # trainer.profile_steps=[1] (the fixture): the first good step's trace, and its line naming an operator
    profile = Path(loop.run_until_complete(single.config.call_one())["profile_dir"])
    assert [p.name for p in profile.iterdir()] == ["rank0_step1.json.gz"] and "aten::" in m["profile/summary"]
    assert not torch.equal(loop.run_until_complete(single.logprobs.call_one(probe)), before)


def test_export_hf_loads_in_transformers_with_identical_logits(loop, single, tmp_path):
    from transformers import AutoModelForCausalLM

    steps(loop, single, 1, seeds=(0,))  # export trained weights, not the shipped ones
    out = loop.run_until_complete(single.export_hf.call_one(str(tmp_path / "hf")))
    probe = make_batch(5)
    ours = loop.run_until_complete(single.logprobs.call_one(probe))
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(hf(probe.tokens).logits.float(), -1)
    theirs = logp[:, :-1].gather(-1, probe.tokens[:, 1:, None])[..., 0]
    assert (ours[:, 1:] - theirs).abs().max().item() < 1e-5
    shipped = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    assert not torch.equal(hf.model.embed_tokens.weight, shipped.model.embed_tokens.weight)


def test_save_kill_load_continues_identically(loop, tmp_path):
    cfg = config(tmp_path)
    first = spawn(loop, cfg)
    steps(loop, first, 1, seeds=(0,))
    path = loop.run_until_complete(first.save.call_one())
    expected = steps(loop, first, 1, seeds=(1, 2))
    # SIGKILL the trainer's proc: nothing of it survives but the checkpoint on disk
    echo = first._forge_proc_mesh.spawn("echo", Echo)
    _, pid = loop.run_until_complete(echo.who.call_one())
    os.kill(pid, signal.SIGKILL)
    second = spawn(loop, cfg)
    assert loop.run_until_complete(second.load.call_one()) == 1 and path.endswith("step-1")
    got = steps(loop, second, 1, seeds=(1, 2))
    for e, g in zip(expected, got):
        assert e["loss"] == pytest.approx(g["loss"], abs=1e-7) and e["step"] == g["step"]
    with pytest.raises(ActorError, match="not a DCP checkpoint"):
        loop.run_until_complete(second.load.call_one(str(tmp_path)))


def test_push_weights_from_one_and_from_sharded_ranks(loop, tmp_path):
    """1 proc, FSDP2 and TP on 2 procs publish the same weights, each rank writing its shards or (as ranks on
    several hosts do) rank 0 writing what every rank sends it, a block of rows at a time; readers get full HF
    tensors, bit-exact. Sending, no rank holds more than its shard of one tensor, or one block. One trainer per
    layout publishes every way out of it, one version each."""
    from safetensors.torch import load_file

    from forge_rl.runtime import stop_actor
    from forge_rl.weights import ShmWeightStore
    from tests.support.publish_trainer import PublishSettingTrainer

    shipped = load_file(TINY_MODEL / "model.safetensors")
    store = ShmWeightStore()
    block_mb = 0.01  # 10 KiB: 20 rows of the 128-wide tensors, so shards and fused q/k/v go in several blocks
    try:
        layouts = [  # (procs, parallel layout, [(publish_from, block MiB), ...])
            (1, {}, [("auto", 64)]),
            (2, dict(dp_shard=2), [("auto", 64), ("rank0", 64), ("rank0", block_mb)]),
            (2, dict(dp_shard=1, tp=2), [("auto", 64), ("rank0", 64)]),
        ]
        largest = max(t.nbytes for t in shipped.values())
        version = 0
        for index, (procs, parallel, ways) in enumerate(layouts):
            cfg = config(tmp_path / str(index), **parallel)
            trainer = loop.run_until_complete(PublishSettingTrainer.options(procs=procs, spmd=True).as_actor(cfg))
            for publish_from, block in ways:
                version += 1
                loop.run_until_complete(trainer.set_publishing.call(publish_from, block))
                records = loop.run_until_complete(trainer.push_weights.call(version))
                record = records.item(procs=0)
                got = store.load(version)
                assert set(got) == set(shipped) and record["bytes"] == sum(t.nbytes for t in shipped.values())
                bound = block * 2**20 if block < 1 else largest / 2  # a block, or half the largest tensor
                for rank in range(procs):  # from rank 0: the blocks sent; each rank writing its own: none
                    held = records.item(procs=rank)["largest_held_bytes"]
                    assert (publish_from == "auto") <= (held <= bound), (version, rank)
                    assert (publish_from == "rank0") <= (0 < held), (version, rank)
                for name, tensor in shipped.items():
                    assert torch.equal(got[name], tensor), (version, name)
                del got
            loop.run_until_complete(stop_actor(trainer))
        assert version == 6
    finally:
        store.close()


def test_fsdp_over_tp_publishes_checkpoints_and_exports_bit_exact_in_blocks(loop, tmp_path):
    """The 32B layout in miniature: 4 procs, dp_shard 2 x tp 2, so FSDP2 strided-shards TP's dim-0 shards (wqkv, w1,
    w3, the head). Every path out works from each rank's own rows, a block at a time: the shipped weights publish
    bit-exact from every rank's shards; after a step, a DCP checkpoint loaded by a fresh 2 x 2 trainer publishing from
    rank 0, and the HF export streamed to rank 0, hold exactly what the first trainer published; no rank ever held
    more than one 10 KiB block (a whole tensor is up to 64 KiB here)."""
    from safetensors.torch import load_file

    from forge_rl.runtime import stop_actor
    from forge_rl.weights import ShmWeightStore

    shipped = load_file(TINY_MODEL / "model.safetensors")
    block = 0.01  # MiB
    store = ShmWeightStore()
    try:
        cfg = config(tmp_path, dp_shard=2, tp=2)
        cfg.publish_block_mb = block
        first = spawn(loop, cfg, procs=4)
        held = [loop.run_until_complete(first.push_weights.call(1))]
        got = store.load(1)
        assert set(got) == set(shipped) and all(torch.equal(got[k], t) for k, t in shipped.items())
        del got
        steps(loop, first, 2, seeds=(0,))
        held.append(loop.run_until_complete(first.push_weights.call(2)))
        checkpoint = loop.run_until_complete(first.save.call()).item(procs=0)
        export = loop.run_until_complete(first.export_hf.call(str(tmp_path / "hf"))).item(procs=0)
        loop.run_until_complete(stop_actor(first))

        cfg.publish_from = "rank0"
        second = spawn(loop, cfg, procs=4)
        assert loop.run_until_complete(second.load.call(checkpoint)).item(procs=0) == 1
        held.append(loop.run_until_complete(second.push_weights.call(3)))
        loop.run_until_complete(stop_actor(second))
        trained, reloaded, exported = store.load(2), store.load(3), load_file(f"{export}/model.safetensors")
        assert not torch.equal(trained["model.embed_tokens.weight"], shipped["model.embed_tokens.weight"])
        for name, tensor in trained.items():
            assert torch.equal(reloaded[name], tensor) and torch.equal(exported[name], tensor), name
        for records in held:
            assert all(r["largest_held_bytes"] <= block * 2**20 for r in records.values())
        assert max(r["largest_held_bytes"] for r in held[-1].values()) > 0  # the rank-0 stream's blocks
    finally:
        store.close()


@pytest.mark.parametrize("procs,publish_from", [(1, "auto"), (2, "rank0")], ids=["one-rank", "from-rank0"])
def test_push_weights_into_a_full_tmpfs_fails_by_name_and_the_trainer_goes_on(loop, tmp_path, procs, publish_from):
    """The store's root on a real tmpfs with room for 2.5 versions of the tiny model, one taken by a
    filler file: push 1 fits, push 2 comes back to the caller as WeightStoreFull naming the store and
    the bytes, and leaves version 1 as it was. The trainer goes on: it trains, and once the filler is
    gone push 2 publishes. Publishing from rank 0, the other rank hears of the failure instead of waiting
    to send."""
    from safetensors.torch import load_file

    from forge_rl.runtime import stop_actor
    from forge_rl.weights import ShmWeightStore, WeightStoreConfig

    shipped = load_file(TINY_MODEL / "model.safetensors")
    size = sum(t.nbytes for t in shipped.values())  # a version is this plus its header (a few KB)
    with small_tmpfs(tmp_path / "shm", 5 * size // 2) as shm:
        with open(shm / "filler", "wb") as f:
            os.posix_fallocate(f.fileno(), 0, size)
        store_cfg = WeightStoreConfig(keep_versions=2, root=str(shm / "weights"))
        cfg = config(tmp_path, **(dict(dp_shard=2) if procs == 2 else {}))
        cfg.publish_from = publish_from
        trainer = loop.run_until_complete(Trainer.options(procs=procs, spmd=True).as_actor(cfg, store_cfg))
        store = ShmWeightStore(cfg=store_cfg)
        try:
            loop.run_until_complete(trainer.push_weights.call(1))
            with pytest.raises(
                ActorError,
                match=rf"WeightStoreFull.*weight store {shm}/weights is full: weights "
                rf"version 2 needs \d+ bytes .*, \d+ bytes .* free",
            ):
                loop.run_until_complete(trainer.push_weights.call(2))
            assert os.listdir(store.root) == ["v00000001"]
            v1 = store.load(1)
            assert all(torch.equal(v1[name], t) for name, t in shipped.items())
            del v1
            assert steps(loop, trainer, procs, seeds=(0,))[0]["step"] == 1
            (shm / "filler").unlink()
            loop.run_until_complete(trainer.push_weights.call(2))
            v2 = store.load(2)
            assert v2.keys() == shipped.keys() and not torch.equal(v2["lm_head.weight"], shipped["lm_head.weight"])
            del v2
        finally:
            store.close()
            loop.run_until_complete(stop_actor(trainer))  # its maps of the tmpfs's files go with it


@pytest.mark.parametrize("procs,parallel", [(1, {}), (2, dict(dp_shard=2))], ids=["autocast", "fsdp2"])
def test_bf16_compute_keeps_fp32_masters_so_tiny_updates_land(loop, tmp_path, procs, parallel):
    """trainer.dtype=bfloat16 computes in bf16 but steps fp32 master weights: one AdamW step at lr 1e-6
    moves each weight by ~lr (Adam's first step is lr * sign(grad)), an update far below bf16's resolution
    near 0.02 (~1e-4) that a bf16 parameter would round away. Published weights and the default export are bf16."""
    from safetensors.torch import load_file

    from forge_rl.runtime import stop_actor
    from forge_rl.weights import ShmWeightStore

    lr = 1e-6
    cfg = config(tmp_path, **parallel)
    cfg.dtype, cfg.optim = "bfloat16", OptimizerConfig(lr=lr, max_grad_norm=0.0)
    trainer = spawn(loop, cfg, procs=procs)
    masters = lambda out: load_file(  # noqa: E731 -- the fp32 masters, exported as they are
        loop.run_until_complete(trainer.export_hf.call(str(tmp_path / out), "float32")).item(procs=0)
        + "/model.safetensors"
    )
    before = masters("before")
    (metrics,) = steps(loop, trainer, procs, seeds=(0,))
    after = masters("after")
    assert 0 < metrics["mfu"] < 1  # against the faster of bf16 and fp32 matmuls, measured on a CPU
    default = loop.run_until_complete(trainer.export_hf.call(str(tmp_path / "default"))).item(procs=0)
    assert all(t.dtype == torch.bfloat16 for t in load_file(default + "/model.safetensors").values())
    store = ShmWeightStore()
    try:
        loop.run_until_complete(trainer.push_weights.call(1))
        published = store.load(1)
        assert all(t.dtype == torch.bfloat16 for t in published.values())
    finally:
        store.close()
        loop.run_until_complete(stop_actor(trainer))
    name = "model.layers.0.mlp.down_proj.weight"
    assert before[name].dtype == torch.float32
    delta = (after[name] - before[name]).abs().flatten()
    moved = delta[delta > 0]
    assert moved.numel() > 0.9 * delta.numel()  # nearly every weight changed
    assert moved.median().item() == pytest.approx(lr, rel=0.05)
    assert delta.max().item() <= lr * 1.01


def test_non_finite_steps_are_skipped_counted_and_stop_the_run_in_a_row(loop, tmp_path):
    """Corrupt behaviour logprobs (-1e4) overflow the importance ratio: the step leaves the weights as
    they were and is counted; a good step resets the count; max_nonfinite_steps in a row raise."""
    from forge_rl.runtime import stop_actor

    cfg = config(tmp_path)
    cfg.max_nonfinite_steps = 2
    trainer = spawn(loop, cfg)
    probe = make_batch(7)

    def bad() -> TrainBatch:
        b = make_batch(3)
        b.behaviour_logprobs[b.response_mask] = -1e4
        b.advantages[:] = -1.0
        return b

    def train(batch) -> dict:
        return loop.run_until_complete(trainer.step.call([batch])).item(procs=0)

    try:
        before = loop.run_until_complete(trainer.logprobs.call_one(probe))
        m = train(bad())
        assert m["skipped"] == 1 and m["skipped_steps"] == 1 and not math.isfinite(m["grad_norm"])
        assert torch.equal(loop.run_until_complete(trainer.logprobs.call_one(probe)), before)
        m = train(make_batch(0))  # a good step updates and resets the run of bad ones
        assert m["skipped"] == 0 and m["skipped_steps"] == 1
        assert not torch.equal(loop.run_until_complete(trainer.logprobs.call_one(probe)), before)
        train(bad())
        with pytest.raises(ActorError, match="2 train steps in a row had a non-finite gradient norm"):
            train(bad())
    finally:
        loop.run_until_complete(stop_actor(trainer))
