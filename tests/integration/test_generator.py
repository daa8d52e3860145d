"""Generator actor on a real vLLM CPU engine (one engine shared by every test here): logprobs, bad input,
concurrency, trainer parity, and live weight updates in all three swap modes."""

import asyncio
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from forge_rl.models import TINY_MODEL_DIR

PROMPT = "<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def hf_model():
    return AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def generator():
    from forge_rl.actors.generator import Generator
    from forge_rl.runtime import provisioned

    loop = asyncio.new_event_loop()
    ctx = provisioned()
    loop.run_until_complete(ctx.__aenter__())
    svc = loop.run_until_complete(
        # kept sets of up to the whole (128-token) vocabulary: this random model's top_p=0.8 keeps ~90 ids
        Generator.options(replicas=1).as_service(
            str(TINY_MODEL_DIR), engine_args=dict(max_model_len=128), max_kept_tokens=128
        )
    )
    yield loop, svc
    loop.run_until_complete(ctx.__aexit__(None, None, None))
    loop.close()


def test_vllm_logprobs_match_hf_log_softmax(generator, hf_model):
    loop, svc = generator
    completions = loop.run_until_complete(svc.generate.route(PROMPT, n=8, temperature=1.0, max_tokens=12))
    assert len(completions) == 8
    gaps = []
    for c in completions:
        assert c.finish_reason in ("stop", "length") and (c.policy_versions == 0).all()
        ids = torch.cat([c.prompt_ids, c.response_ids])[None]
        with torch.no_grad():
            logp = torch.log_softmax(hf_model(ids).logits[0], dim=-1)
        P = len(c.prompt_ids)
        ref = logp[P - 1 : -1].gather(-1, c.response_ids[:, None])[:, 0]
        gaps.append((ref - c.logprobs).abs().max().item())
    assert max(gaps) < 1e-4


def test_generator_rejects_bad_input_and_keeps_serving(generator):
    from monarch.actor import ActorError

    loop, svc = generator
    cases = [
        (("",), dict(n=2), "prompt is empty"),
        ((PROMPT,), dict(n=0), "n must be >= 1"),
        (("x" * 200,), dict(n=1), "max_model_len is 128"),
        ((PROMPT,), dict(n=1, max_tokens=120), "exceeds the engine's max_model_len=128"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ActorError, match=message):
            loop.run_until_complete(svc.generate.route(*args, **kwargs))
    token_ids = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)(PROMPT)["input_ids"]
    again = loop.run_until_complete(svc.generate.route(token_ids, n=2, max_tokens=4))
    assert len(again) == 2 and all(len(c.response_ids) <= 4 for c in again)
    assert svc.service_stats.retries == 0 and svc.healthy_replicas == 1


def test_every_completion_records_its_sampling_and_the_buffer_refuses_an_override_the_trainer_cannot_reproduce(
    generator,
):
    """A notebook or a custom loop calling the generator with top_p gets episodes the buffer will not train on
    (their behaviour logprobs are of a truncated distribution); greedy evaluation calls stay free."""
    from forge_rl.actors.replay_buffer import GroupStore
    from forge_rl.actors.replay_buffer_config import ReplayBufferConfig
    from forge_rl.types import Episode, Group

    loop, svc = generator
    store = GroupStore(ReplayBufferConfig(), temperature=1.0)

    def add(completions) -> bool:
        return store.add(Group("p", [Episode(c, advantage=a) for c, a in zip(completions, (0.5, -0.5))]))

    plain = loop.run_until_complete(svc.generate.route(PROMPT, n=2, max_tokens=4))
    assert plain[0].sampling == {"max_tokens": 4, "temperature": 1.0}
    assert add(plain)
    penalised = loop.run_until_complete(svc.generate.route(PROMPT, n=2, max_tokens=4, repetition_penalty=1.2))
    assert penalised[0].sampling["repetition_penalty"] == 1.2
    with pytest.raises(ValueError, match="episode 0 cannot be trained on: repetition_penalty=1.2 changes the sampling"):
        add(penalised)
    truncated = loop.run_until_complete(svc.generate.route(PROMPT, n=2, max_tokens=4, top_p=0.8))
    assert truncated[0].sampling["top_p"] == 0.8 and truncated[0].kept_offsets is not None
    assert add(truncated)  # its kept sets are recorded: the trainer reproduces it
    greedy = [
        loop.run_until_complete(svc.generate.route(PROMPT, n=1, max_tokens=4, temperature=0.0))[0] for _ in range(2)
    ]
    assert greedy[0].sampling["temperature"] == 0.0  # evaluation: any sampling
    with pytest.raises(ValueError, match="temperature=0.0 differs from the trainer's 1.0"):
        add(greedy)
    assert store.present == 4


def test_stop_strings_still_work_without_vllm_detokenizing_by_default(generator):
    # The generator turns vLLM's detokenizer off unless stop strings need it.
    loop, svc = generator
    completions = loop.run_until_complete(
        svc.generate.route(PROMPT, n=16, temperature=1.0, max_tokens=12, stop=["4"], seed=3)
    )
    stopped = [c for c in completions if c.finish_reason == "stop" and "4" in c.text]
    assert stopped, "no completion reached the stop string; pick another"
    for c in stopped:
        assert c.text.index("4") == len(c.text) - 1  # generation ended at the first "4"


def test_filler_after_eos_runs_every_response_to_max_tokens_and_masks_the_filler(generator):
    """generator.lengths' requests run to max_tokens whatever the model emits; the text ends at the first
    end-of-sequence token and the tokens after it are masked (tests/unit/loop/test_lengths.py checks that split on
    a model
    that ends its answers); the engine's occupancy counts the request's 4 sequences all along."""
    loop, svc = generator
    N = 96  # as long as max_model_len allows: the tail below is a smaller share of a longer request
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)

    async def body():
        before = await svc.stats.route()
        sampled = await svc.generate.route(PROMPT, n=4, temperature=1.0, max_tokens=N, filler_after_eos=True)
        return sampled, before, await svc.stats.route()

    sampled, before, after = loop.run_until_complete(body())
    for c in sampled:
        ids = c.response_ids.tolist()
        assert len(ids) == N and c.sampling["ignore_eos"] is True
        first = ids.index(tokenizer.eos_token_id) if tokenizer.eos_token_id in ids else None
        if first is None:
            assert c.finish_reason == "length" and c.env_mask is None
        else:
            assert c.finish_reason == "stop" and c.text == tokenizer.decode(ids[:first], skip_special_tokens=True)
            assert (c.env_mask is None and first == N - 1) or c.env_mask.tolist() == [i > first for i in range(N)]
    occupancy = (after["sequence_s"] - before["sequence_s"]) / (after["busy_s"] - before["busy_s"])
    # 4 all along; the 4 finish in one engine step, but their outputs may reach the actor a moment apart: on a busy
    # 2-core machine up to a fifth of a 40-token request's time (3.19 seen), under a tenth of this one's. Sequences
    # that ended at their end-of-sequence token (tiny-warm's answers are a few tokens) would give ~1-2
    assert 3.5 < occupancy <= 4.0 and after["running_sequences"] == 0


def test_occupancy_falls_while_a_long_request_runs_alone(generator):
    loop, svc = generator

    async def body():
        before = await svc.stats.route()
        await asyncio.gather(
            svc.generate.route(PROMPT, n=2, max_tokens=8, ignore_eos=True),
            svc.generate.route(PROMPT, n=2, max_tokens=100, ignore_eos=True),
        )
        return before, await svc.stats.route()

    before, after = loop.run_until_complete(body())
    occupancy = (after["sequence_s"] - before["sequence_s"]) / (after["busy_s"] - before["busy_s"])
    # 4 sequences for 8 of 100 tokens, then 2: 2.16. The long request's 2 sequences finish in one engine step, but
    # their outputs may reach the actor a moment apart, 1 running meanwhile (1.96 seen on a busy 2-core machine)
    assert 1.6 < occupancy < 3.0, occupancy
    assert after["running_sequences"] == 0


def test_concurrent_generate_calls_share_the_engine(generator):
    loop, svc = generator

    async def many():
        return await asyncio.gather(
            *(svc.generate.route(PROMPT, n=2, max_tokens=16, ignore_eos=True) for _ in range(8))
        )

    groups = loop.run_until_complete(many())
    assert [len(g) for g in groups] == [2] * 8
    stats = loop.run_until_complete(svc.stats.route())
    assert stats["max_concurrent_requests"] >= 4  # calls overlap in the engine instead of queueing in the actor


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trainer_logprobs_equal_generator_behaviour_logprobs(generator, temperature):
    """The trainer reproduces the behaviour policy that the sampling config defines (its temperature is
    read from that config, as the GRPO app does), to 1e-4 in fp32."""
    from forge_rl.actors.trainer import Trainer
    from forge_rl.actors.trainer_config import TrainerConfig
    from forge_rl.runtime import stop_actor
    from forge_rl.loop.sampling import behaviour_temperature
    from forge_rl.types import Episode, TrainBatch

    loop, svc = generator
    sampling = dict(temperature=temperature, max_tokens=12)
    completions = loop.run_until_complete(svc.generate.route(PROMPT, n=8, **sampling))
    batch = TrainBatch.collate([Episode(c, advantage=0.0) for c in completions], pad_id=0)
    cfg = TrainerConfig(model=str(TINY_MODEL_DIR), temperature=behaviour_temperature(sampling))
    trainer = loop.run_until_complete(Trainer.options(spmd=True).as_actor(cfg))
    ours = loop.run_until_complete(trainer.logprobs.call_one(batch))
    loop.run_until_complete(stop_actor(trainer))
    gap = (ours - batch.behaviour_logprobs)[batch.response_mask].abs().max().item()
    assert gap < 1e-4
    if temperature != 1.0:  # under the untempered policy the same tokens are far off: the check has teeth
        assert (untempered_logprobs(completions[0]) - completions[0].logprobs).abs().max() > 1e-2


TRUNCATIONS = [dict(top_p=0.8), dict(top_k=20), dict(min_p=0.05), dict(top_p=0.95, top_k=20)]


def test_trainer_reproduces_truncated_sampling_over_the_recorded_kept_sets(generator):
    """Keep Sampling Mask through the Generator's per-call options: each token carries the ids it was drawn from,
    and the trainer's logprobs renormalised over them equal the behaviour logprobs (fp32, T=0.7), for each sampler
    in one batch with an untruncated group. (On this random model min_p=0.05 keeps every id; the GRPO run of
    tests/integration/test_mismatch.py takes the samplers from the config, on tiny-warm, where it keeps 2-3.)"""
    from dataclasses import replace

    from forge_rl.actors.trainer import Trainer
    from forge_rl.actors.trainer_config import TrainerConfig
    from forge_rl.runtime import stop_actor
    from forge_rl.types import Episode, TrainBatch

    loop, svc = generator
    groups = [
        loop.run_until_complete(svc.generate.route(PROMPT, n=4, temperature=0.7, max_tokens=12, **t))
        for t in [*TRUNCATIONS, {}]
    ]
    for t, group in zip(TRUNCATIONS, groups):
        for c in group:
            sizes = (c.kept_offsets[1:] - c.kept_offsets[:-1]).tolist()
            sets = [c.kept_ids[a:b].tolist() for a, b in zip(c.kept_offsets[:-1], c.kept_offsets[1:])]
            assert all(int(tok) in s for tok, s in zip(c.response_ids, sets)) and c.kept_over_cap == 0
            assert max(sizes) <= t.get("top_k", 128) and min(sizes) >= 1, (t, sizes)
    assert groups[-1][0].kept_ids is None  # untruncated: nothing recorded
    batch = TrainBatch.collate([Episode(c, advantage=0.0) for g in groups for c in g], pad_id=0)
    cfg = TrainerConfig(model=str(TINY_MODEL_DIR), temperature=0.7)
    trainer = loop.run_until_complete(Trainer.options(spmd=True).as_actor(cfg))
    ours = loop.run_until_complete(trainer.logprobs.call_one(batch))
    full = loop.run_until_complete(trainer.logprobs.call_one(replace(batch, kept=None)))  # the whole vocabulary
    loop.run_until_complete(stop_actor(trainer))
    gap, full_gap = (ours - batch.behaviour_logprobs).abs(), (full - batch.behaviour_logprobs).abs()
    for i, t in enumerate([*TRUNCATIONS, {}]):
        rows = batch.response_mask[4 * i : 4 * i + 4]
        assert gap[4 * i : 4 * i + 4][rows].mean() < 1e-4 and gap[4 * i : 4 * i + 4][rows].max() < 1e-3, t
        if t and t != dict(min_p=0.05):  # the check has teeth: over the whole vocabulary they are far off
            assert full_gap[4 * i : 4 * i + 4][rows].mean() > 1e-2, t
    assert loop.run_until_complete(svc.stats.route())["sampling_mask_bytes_per_token"] > 4


def test_a_top_k_over_the_cap_is_refused_by_the_generator(generator):
    from monarch.actor import ActorError

    loop, svc = generator
    with pytest.raises(ActorError, match="top_k=129 keeps more tokens than the generator records"):
        loop.run_until_complete(svc.generate.route(PROMPT, n=1, max_tokens=2, top_k=129))


def untempered_logprobs(completion) -> torch.Tensor:
    """log softmax(logits) of each sampled response token under the HF model (temperature 1)."""
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32).eval()
    ids = torch.cat([completion.prompt_ids, completion.response_ids])[None]
    with torch.no_grad():
        logits = model(ids).logits[0, len(completion.prompt_ids) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, completion.response_ids[:, None])[:, 0]


# ---- live weight updates ------------------------------------------------------------------------


def perturbed_weights(seed: int) -> dict[str, torch.Tensor]:
    """The tiny model's weights plus noise: a 'next policy' whose greedy tokens differ from the first."""
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(seed)
    state = load_file(TINY_MODEL_DIR / "model.safetensors")
    state = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied
    return state


def hf_with(state: dict[str, torch.Tensor]):
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32).eval()
    model.load_state_dict(state, strict=False)
    return model


def greedy_gap(model, completion, positions: list[int]) -> float:
    """How far each response token at `positions` is from the model's argmax given its prefix (0 = argmax)."""
    ids = torch.cat([completion.prompt_ids, completion.response_ids])[None]
    with torch.no_grad():
        logits = model(ids).logits[0]
    P = len(completion.prompt_ids)
    gaps = [logits[P + j - 1].max() - logits[P + j - 1, completion.response_ids[j]] for j in positions]
    return max(gaps, default=torch.tensor(0.0)).item()


def swap_during_generation(loop, svc, version: int, mode: str):
    """8 greedy requests of 90 tokens; once they are under way, update_weights(version, mode)."""

    async def body():
        calls = [
            asyncio.ensure_future(svc.generate.route(PROMPT, n=1, temperature=0.0, max_tokens=90, ignore_eos=True))
            for _ in range(8)
        ]
        while (await svc.stats.route())["tokens_generated_in_flight"] < 8 * 5:
            await asyncio.sleep(0.01)
        record = (await svc.update_weights.call_all(version, mode=mode))[0]
        return [c[0] for c in await asyncio.gather(*calls)], record

    return loop.run_until_complete(body())


@pytest.fixture(scope="module")
def store():
    from forge_rl.weights import ShmWeightStore

    s = ShmWeightStore()  # the run id of the generator fixture's provisioner (env FORGE_RL_RUN_ID)
    yield s
    s.close()


def test_recompute_kv_swap_mid_generation(generator, hf_model, store):
    loop, svc = generator
    new = perturbed_weights(1)
    store.publish(1, new)
    completions, record = swap_during_generation(loop, svc, 1, "recompute_kv")
    new_model = hf_with(new)
    switched = 0
    for c in completions:
        versions = c.policy_versions.tolist()
        k = versions.index(1) if 1 in versions else len(versions)
        assert versions == [0] * k + [1] * (len(versions) - k)  # tags switch once, at one token
        assert greedy_gap(hf_model, c, list(range(k))) < 1e-4  # before: the old weights' greedy tokens
        assert greedy_gap(new_model, c, list(range(k, len(versions)))) < 1e-4  # after: the new weights'
        switched += 0 < k < len(versions)
    assert switched >= 4, "the update should land while most requests are mid-sequence"
    assert record["requests_in_flight"] >= 4 and record["tokens_in_flight"] > 0 and record["pause_s"] < 5
    assert loop.run_until_complete(svc.version.route()) == 1


def test_keep_kv_continues_without_draining(generator, store):
    loop, svc = generator
    store.publish(2, perturbed_weights(2))
    completions, record = swap_during_generation(loop, svc, 2, "keep_kv")
    assert record["drain_wait_s"] == 0.0 and record["requests_in_flight"] >= 4
    assert sum(0 < c.policy_versions.eq(2).sum() < len(c.response_ids) for c in completions) >= 4
    assert all(len(c.response_ids) == 90 for c in completions)


def test_drain_waits_for_in_flight_requests(generator, store):
    loop, svc = generator
    store.publish(3, perturbed_weights(3))
    completions, record = swap_during_generation(loop, svc, 3, "drain")
    assert all((c.policy_versions == 2).all() for c in completions)  # finished on the old weights
    assert record["drain_wait_s"] > 0.1
    assert loop.run_until_complete(svc.version.route()) == 3


def test_update_to_a_dropped_version_names_the_versions(generator, store):
    from monarch.actor import ActorError

    loop, svc = generator
    store.publish(4, load_tiny())  # back to the shipped weights; keep_versions=2 drops 1 and 2
    with pytest.raises(ActorError, match=r"version 1 .*versions available: \[3, 4\]"):
        loop.run_until_complete(svc.update_weights.call_all(1))
    assert loop.run_until_complete(svc.update_weights.call_all(4))[0]["version"] == 4
    stats = loop.run_until_complete(svc.stats.route())
    assert stats["weight_updates"] == 4 and stats["policy_version"] == 4


def load_tiny() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(TINY_MODEL_DIR / "model.safetensors")


def test_misspelt_sampling_option_fails_at_start(generator):
    from monarch.actor import ActorError

    from forge_rl.actors.generator import Generator

    loop, _ = generator
    with pytest.raises(ActorError, match="generator sampling .*temprature"):
        loop.run_until_complete(Generator.as_actor(str(TINY_MODEL_DIR), sampling={"temprature": 0.7}))


def test_killed_replica_is_respawned_and_its_group_retried(generator, store):
    """The respawned replica catches up to the newest published weights before it takes the retried call
    (it never serves the shipped weights mid-run). The killed proc's vLLM engine processes do not outlive
    it, nor does their shared memory (forge_rl.runtime.reaper)."""
    import os
    import signal

    import psutil

    from forge_rl.runtime.reaper import _shm_files

    loop, svc = generator

    async def body():
        victim = (await svc.stats.route())["pid"]
        engine_procs = psutil.Process(victim).children(recursive=True)
        engine_shm = _shm_files([p.pid for p in engine_procs])
        names = [p.name() for p in engine_procs]
        call = asyncio.ensure_future(svc.generate.route(PROMPT, n=8, temperature=1.0, max_tokens=90, ignore_eos=True))
        while (await svc.stats.route())["tokens_generated_in_flight"] < 8:
            assert not call.done(), "the group finished before the kill"
            await asyncio.sleep(0.005)
        os.kill(victim, signal.SIGKILL)  # the replica's proc; its vLLM engine processes follow their parent
        group = await asyncio.wait_for(call, 240)
        _, alive = psutil.wait_procs(engine_procs, timeout=30)
        return victim, group, await svc.stats.route(), names, alive, engine_shm

    victim, group, stats, names, alive, engine_shm = loop.run_until_complete(body())
    # A generator pinned to one core has no Worker process and so no broadcast segment (engine_shm may be
    # empty); the reaper's removal of a mapped segment is tested on its own in test_shutdown.
    assert not [f for f in engine_shm if os.path.exists(f)], "the killed engine's shared memory was left behind"
    assert len(names) >= 2 and any("EngineCor" in n for n in names), names  # it, and the reaper
    assert not alive, f"processes of the killed replica still run: {alive}"
    assert len(group) == 8 and all(len(c.response_ids) == 90 for c in group)  # the whole group, once
    newest = max(store.versions())
    assert stats["pid"] != victim and stats["policy_version"] == newest > 0
    assert all((c.policy_versions == newest).all() for c in group)  # the retried group: the current weights
    assert svc.service_stats.respawns == 1 and svc.service_stats.retries == 1


def test_a_dead_engine_gets_its_replica_replaced(generator):
    """vLLM's EngineCore dies under a replica (here: SIGKILL): the replica ends its proc, the Service
    respawns it and the group in flight is retried. Runs after the replica-kill test (counts add up)."""
    import signal

    import psutil

    loop, svc = generator
    respawns, retries = svc.service_stats.respawns, svc.service_stats.retries

    async def body():
        victim = (await svc.stats.route())["pid"]
        (core,) = [p for p in psutil.Process(victim).children(recursive=True) if "EngineCore" in p.name()]
        call = asyncio.ensure_future(svc.generate.route(PROMPT, n=8, temperature=1.0, max_tokens=90, ignore_eos=True))
        while (await svc.stats.route())["tokens_generated_in_flight"] < 8:
            assert not call.done(), "the group finished before the kill"
            await asyncio.sleep(0.005)
        core.send_signal(signal.SIGKILL)
        group = await asyncio.wait_for(call, 240)
        return victim, group, await svc.stats.route()

    victim, group, stats = loop.run_until_complete(body())
    assert len(group) == 8 and all(len(c.response_ids) == 90 for c in group)
    assert stats["pid"] != victim and not psutil.pid_exists(victim)
    assert svc.service_stats.respawns == respawns + 1 and svc.service_stats.retries == retries + 1


def test_hold_stops_engine_steps_until_release(generator):
    """Colocated placement: a held generator makes no progress (its cores are the trainer's), keeps the
    request, and finishes it after release."""
    loop, svc = generator

    async def body():
        busy_before, start = (await svc.stats.route())["busy_s"], time.perf_counter()
        await svc.hold.call_all()
        call = asyncio.ensure_future(svc.generate.route(PROMPT, n=2, temperature=1.0, max_tokens=20, ignore_eos=True))
        await asyncio.sleep(1.0)
        assert not call.done()
        assert (await svc.stats.route())["tokens_generated_in_flight"] == 0
        await svc.release.call_all()
        out = await asyncio.wait_for(call, 60)
        assert [len(c.response_ids) for c in out] == [20, 20]
        stats, elapsed = await svc.stats.route(), time.perf_counter() - start
        assert stats["held_s"] >= 1.0
        # the second the request waited while held is not generation time
        assert stats["busy_s"] - busy_before <= elapsed - 1.0

    loop.run_until_complete(body())


def test_version_tags_are_exact_under_load_across_repeated_swaps(generator, store):
    """Many sequences in flight, weights swapped three times: every token's tag is the version whose weights
    sampled it. Checked by logprobs: each token's behaviour logprob equals log_softmax of the HF model of
    its tagged version (recompute_kv recomputes the prefix under the new weights), so a token tagged one
    version late or early would be off by far more than 1e-4."""
    loop, svc = generator

    async def body():
        base = await svc.version.route()
        weights = {base + 1 + i: perturbed_weights(10 + i) for i in range(4)}
        store.publish(base + 1, weights[base + 1])
        await svc.update_weights.call_all(base + 1)  # a known starting point, nothing in flight
        calls = [
            asyncio.ensure_future(svc.generate.route(PROMPT, n=2, temperature=1.0, max_tokens=70, ignore_eos=True))
            for _ in range(16)
        ]
        for v in range(base + 2, base + 5):
            store.publish(v, weights[v])
            target = (await svc.stats.route())["tokens_generated_in_flight"] + 150
            while (await svc.stats.route())["tokens_generated_in_flight"] < target:
                await asyncio.sleep(0.005)
            await svc.update_weights.call_all(v, mode="recompute_kv")
        return [c for group in await asyncio.gather(*calls) for c in group], weights

    completions, weights = loop.run_until_complete(body())
    models = {v: hf_with(w) for v, w in weights.items()}
    seen = set()
    for c in completions:
        versions = c.policy_versions.tolist()
        assert versions == sorted(versions)
        ids = torch.cat([c.prompt_ids, c.response_ids])[None]
        P = len(c.prompt_ids)
        for v in set(versions):
            with torch.no_grad():
                logits = models[v](ids).logits[0, P - 1 : -1]
            expected = torch.log_softmax(logits, -1).gather(-1, c.response_ids[:, None])[:, 0]
            mine = c.policy_versions == v
            assert (expected[mine] - c.logprobs[mine]).abs().max() < 1e-4, (v, versions)
        seen |= set(versions)
    assert len(seen) >= 3, f"swaps should land mid-sequence; saw versions {sorted(seen)}"


def test_a_request_older_than_max_age_is_aborted_at_the_swap_and_the_others_finish(generator, store):
    """stale_in_flight "requeue": loading version u + max_age + 1 aborts a request started under u in the engine
    (SequenceTooOld, with the tokens it had made); a request allowed one more version, or no limit, finishes."""
    from forge_rl.actors.generator import SequenceTooOld

    loop, svc = generator

    async def body():
        base = await svc.version.route()
        store.publish(base + 1, load_tiny())
        long = dict(n=2, temperature=1.0, max_tokens=100, ignore_eos=True)
        aged, kept, free = (
            asyncio.ensure_future(svc.generate.route(PROMPT, **long, **age))
            for age in ({"max_age": 0}, {"max_age": 1}, {})
        )
        while (await svc.stats.route())["tokens_generated_in_flight"] < 30:
            await asyncio.sleep(0.005)
        await svc.update_weights.call_all(base + 1)
        results = await asyncio.gather(aged, kept, free, return_exceptions=True)
        return base, results, await svc.stats.route()

    base, (aged, kept, free), stats = loop.run_until_complete(body())
    error = getattr(aged, "exception", aged)
    assert isinstance(error, SequenceTooOld) and 0 < error.tokens < 200, aged
    for out in (kept, free):
        assert [len(c.response_ids) for c in out] == [100, 100]
        assert all(c.policy_versions[0] == base and c.policy_versions[-1] == base + 1 for c in out)
    assert stats["aborted_too_old"] == 1
    assert stats["unfinished_requests"] == 0 and stats["running_sequences"] == 0  # nothing left in the engine
