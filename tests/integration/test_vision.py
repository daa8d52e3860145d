"""Image prompts through a Generator on a real vLLM CPU engine and the embedded tiny VLM (tiny-vlm, Idefics3): the
digit-sum task's rows rendered by the model's processor, sampled with per-token logprobs; the image conditions the
output; a group of G samples of one image; two images in one prompt; a placeholder count the images do not match
refused in one line while the engine keeps serving; transformers computing the engine's logprobs from the same pixels;
the run's task rollout and held-out evaluation sampling each row with its images, the batch recording them. One
engine for the module."""

import asyncio
import dataclasses
import itertools

import pytest

from forge_rl.data import digit_sum
from forge_rl.data.vision import load_processor, render_image_prompt, with_images
from forge_rl.models import resolve_model_path

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def processor():
    return load_processor(resolve_model_path("tiny-vlm"))


@pytest.fixture(scope="module")
def rows():
    return list(itertools.islice(digit_sum.training_rows(seed=0), 3))


@pytest.fixture(scope="module")
def transformers_model():
    """transformers' Idefics3 of tiny-vlm in fp32: the reference the engine's logprobs are checked against."""
    import torch
    from transformers import Idefics3ForConditionalGeneration

    return Idefics3ForConditionalGeneration.from_pretrained(resolve_model_path("tiny-vlm"), dtype=torch.float32).eval()


def prompt_of(processor, text: str, n_images: int) -> str:
    messages = with_images([{"role": "user", "content": text}], n_images, "test")
    return render_image_prompt(processor, messages, n_images, "test")


@pytest.fixture(scope="module")
def generator():
    from forge_rl.actors.generator import Generator
    from forge_rl.runtime import provisioned

    loop = asyncio.new_event_loop()
    ctx = provisioned()
    loop.run_until_complete(ctx.__aenter__())
    svc = loop.run_until_complete(
        Generator.options(replicas=1).as_service(
            resolve_model_path("tiny-vlm"), engine_args=dict(max_model_len=256, block_size=32)
        )
    )
    yield loop, svc
    loop.run_until_complete(ctx.__aexit__(None, None, None))
    loop.close()


def generate(generator, prompt, images, **kwargs):
    loop, svc = generator
    kwargs = dict(temperature=1.0, max_tokens=MAX_TOKENS) | kwargs
    return loop.run_until_complete(svc.generate.route(prompt, images=images, **kwargs))


def test_an_image_prompt_samples_a_group_with_logprobs_and_versions(generator, processor, rows):
    from forge_rl.models.build_tiny_vlm import IMAGE_TOKEN_ID, IMAGE_TOKENS

    prompt = prompt_of(processor, rows[0]["prompt"], 1)
    unexpanded = processor.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    group = generate(generator, prompt, [rows[0]["image"]], n=8)
    assert len(group) == 8
    for c in group:
        assert c.finish_reason in ("stop", "length") and 1 <= len(c.response_ids) <= MAX_TOKENS
        assert len(c.logprobs) == len(c.response_ids) and (c.logprobs <= 0).all() and (c.policy_versions == 0).all()
        # the engine's prompt: the one placeholder expanded to the image's tokens, the same for the whole group
        assert (c.prompt_ids == IMAGE_TOKEN_ID).sum() == IMAGE_TOKENS
        assert len(c.prompt_ids) > len(unexpanded) and c.prompt_ids.tolist() == group[0].prompt_ids.tolist()
    assert len({tuple(c.response_ids.tolist()) for c in group}) > 1  # a group of samples, not one sample repeated


def test_the_image_conditions_the_output(generator, processor, rows):
    """Same prompt text and sampling seed: the same image gives the same tokens and logprobs, another image
    other logprobs."""
    prompt = prompt_of(processor, rows[0]["prompt"], 1)
    first, again = (generate(generator, prompt, [rows[0]["image"]], seed=7)[0] for _ in range(2))
    other = generate(generator, prompt, [rows[1]["image"]], seed=7)[0]
    assert first.response_ids.tolist() == again.response_ids.tolist()
    assert (first.logprobs - again.logprobs).abs().max() < 1e-5
    # the first token is drawn with the same random number from each image's distribution
    assert first.response_ids.tolist() != other.response_ids.tolist() or (first.logprobs != other.logprobs).any()
    assert abs(first.logprobs[0] - other.logprobs[0]) > 1e-6 or first.response_ids[0] != other.response_ids[0]


def test_an_image_prompts_cached_blocks_are_reused_for_that_image_only(generator, processor):
    """Prefix caching with images, in the engine's 32-token blocks (block_size): the generator runs a group's image
    prompt once before its samples (`prefill_once`), so every sample of the first group of an image reuses its full
    blocks, as every sample of a later one does; the same text with another image reuses none (the image is in the
    blocks' keys)."""
    loop, svc = generator
    new, other = (r["image"] for r in digit_sum.held_out_rows(2))  # images no other test samples
    prompt = prompt_of(processor, "Add the two digits.", 1)

    def cached(images, n):
        before = loop.run_until_complete(svc.stats.route())
        (c, *_) = generate(generator, prompt, images, n=n)
        after = loop.run_until_complete(svc.stats.route())
        assert after["prompt_tokens"] - before["prompt_tokens"] == n * len(c.prompt_ids)
        return after["prompt_tokens_cached"] - before["prompt_tokens_cached"], len(c.prompt_ids)

    first, prompt_len = cached([new], 8)
    blocks = 32 * (prompt_len // 32)
    assert blocks > 0 and first == 8 * blocks
    assert cached([other], 1)[0] == 0
    assert cached([new], 4)[0] == 4 * blocks


def test_two_images_in_one_prompt(generator, processor, rows):
    from forge_rl.models.build_tiny_vlm import IMAGE_TOKEN_ID, IMAGE_TOKENS

    prompt = prompt_of(processor, "Add <image> and <image>.", 2)
    (c,) = generate(generator, prompt, [rows[0]["image"], rows[2]["image"]])
    assert (c.prompt_ids == IMAGE_TOKEN_ID).sum() == 2 * IMAGE_TOKENS and len(c.logprobs) == len(c.response_ids)


def test_placeholders_the_images_do_not_match_are_refused_and_the_engine_keeps_serving(generator, processor, rows):
    from monarch.actor import ActorError

    loop, svc = generator
    two = prompt_of(processor, "Add <image> and <image>.", 2)
    with pytest.raises(ActorError, match="2 image placeholders .*, more than its 1 images"):
        generate(generator, two, [rows[0]["image"]])
    with pytest.raises(ActorError, match="1 image placeholders .*, more than its 0 images"):
        generate(generator, prompt_of(processor, rows[0]["prompt"], 1), None)
    with pytest.raises(ActorError, match="is not an image PIL can read"):
        generate(generator, prompt_of(processor, rows[0]["prompt"], 1), [b"not an image"])
    (c,) = generate(generator, prompt_of(processor, rows[0]["prompt"], 1), [rows[0]["image"]])
    assert len(c.response_ids) >= 1
    assert svc.service_stats.retries == 0 and svc.healthy_replicas == 1


def test_the_engines_logprobs_are_transformers_on_the_same_pixels(generator, processor, rows, transformers_model):
    """The reference a trainer must reproduce: transformers' Idefics3 on the processor's pixels and the engine's
    expanded prompt ids gives the engine's behaviour logprobs (fp32 on both sides)."""
    import torch

    from forge_rl.data.images import load_image

    prompt = prompt_of(processor, "Add <image> and <image>.", 2)
    images = [rows[0]["image"], rows[1]["image"]]
    group = generate(generator, prompt, images, n=4)
    encoded = processor(text=[prompt], images=[[load_image(i, "test") for i in images]], return_tensors="pt")
    assert encoded["input_ids"][0].tolist() == group[0].prompt_ids.tolist()  # the same expansion
    model = transformers_model
    gaps = []
    for c in group:
        ids = torch.cat([c.prompt_ids, c.response_ids])[None]
        with torch.no_grad():
            logits = model.eval()(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                pixel_values=encoded["pixel_values"],
                pixel_attention_mask=encoded["pixel_attention_mask"],
            ).logits[0]
        reference = torch.log_softmax(logits, dim=-1)[len(c.prompt_ids) - 1 : -1].gather(-1, c.response_ids[:, None])
        gaps.append((reference[:, 0] - c.logprobs).abs().max().item())
    assert max(gaps) < 1e-4


def test_a_task_rollout_samples_its_group_with_the_rows_image_and_the_batch_records_it(generator):
    """The run's rollout of a task with an image column (`rollout_from_dataset`): the dataset's example, rendered
    by the model's own template, is sampled with its image on the real engine; every completion of the group keeps
    the image, and the TrainBatch collated from the group records it for each of its rows."""
    from types import SimpleNamespace

    from forge_rl.data.task import TaskConfig, TaskRows, render, to_example
    from forge_rl.deps.transformers import auto_tokenizer
    from forge_rl.loop.eval import evaluate_task
    from forge_rl.loop.rollout import RolloutStats, rollout_from_dataset
    from forge_rl.models.build_tiny_vlm import IMAGE_TOKEN_ID, IMAGE_TOKENS
    from forge_rl.rewards.exact_match import exact_match
    from forge_rl.types import TrainBatch

    task = TaskConfig(source="digit_sum").resolved()
    example = TaskRows(task, seed=0).next()
    tokenizer = auto_tokenizer(resolve_model_path("tiny-vlm"))
    example = dataclasses.replace(example, text=render(tokenizer, example, task))
    stored = []

    async def score(prompts, completions, finish_reasons, columns):
        values = exact_match(prompts, completions, **columns)
        return values, {"exact_match": values}

    async def add(group):
        stored.append(group)
        return True

    def call(fn):
        return SimpleNamespace(call_one=fn)

    loop, svc = generator
    once = rollout_from_dataset(
        dataset=SimpleNamespace(next=call(lambda: asyncio.sleep(0, example))),
        generator=svc,
        reward=SimpleNamespace(score=call(score)),
        buffer=SimpleNamespace(add=call(add)),
        group_size=4,
        stats=RolloutStats(),
    )
    assert loop.run_until_complete(once) is True
    (group,) = stored
    assert len(example.images) == 1 and len(group) == 4
    for episode in group.episodes:
        c = episode.completion
        assert (c.prompt_ids == IMAGE_TOKEN_ID).sum() == IMAGE_TOKENS and len(c.logprobs) == len(c.response_ids)
        assert c.images == example.images  # the row's PNG bytes, as the trainer will decode them
    batch = TrainBatch.collate(group.episodes, pad_id=0)
    assert batch.images == [example.images] * 4
    text = [dataclasses.replace(e, completion=dataclasses.replace(e.completion, images=())) for e in group.episodes]
    assert TrainBatch.collate(text, pad_id=0).images is None  # a text batch carries none
    # held-out evaluation samples each example with its images too (greedy, scored by the run's reward)
    held_out = [to_example(r, f"held-out {i}", i, task) for i, r in enumerate(digit_sum.held_out_rows(3))]
    held_out = [dataclasses.replace(e, text=render(tokenizer, e, task)) for e in held_out]

    async def score_each_reward(prompts, completions, finish_reasons, columns, only):
        return {"exact_match": exact_match(prompts, completions, **columns)}

    reward = SimpleNamespace(
        score_each_reward=call(score_each_reward), weights=call(lambda: asyncio.sleep(0, {"exact_match": 1.0}))
    )
    scores = loop.run_until_complete(evaluate_task(svc, reward, held_out, "exact_match", max_tokens=MAX_TOKENS))
    assert scores["n"] == 3 and 0.0 <= scores["accuracy"] <= 1.0


def test_the_agent_endpoint_takes_an_image_part(generator, processor, rows):
    """/v1/chat/completions with an OpenAI `image_url` part (a data: URL) samples the image on the engine: the
    same tokens and logprobs as the Generator given the processor's prompt and the image, with the same seed."""
    import base64

    from forge_rl.agents.server import AgentServer, EndpointSettings
    from forge_rl.deps.transformers import auto_tokenizer

    loop, svc = generator
    tokenizer = auto_tokenizer(resolve_model_path("tiny-vlm"))
    server = AgentServer(tokenizer, svc, EndpointSettings("tiny-vlm", {"max_tokens": MAX_TOKENS}, max_model_len=256))
    url = "data:image/png;base64," + base64.b64encode(rows[0]["image"]).decode()
    text = rows[0]["prompt"].replace("<image>", "")  # the image comes as its own part
    body = {
        "model": "tiny-vlm",
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}],
            }
        ],
        "seed": 7,
        "temperature": 1.0,
        "logprobs": True,
        "return_token_ids": True,
    }
    response = loop.run_until_complete(server.chat_completion(None, body))
    (direct,) = generate(generator, prompt_of(processor, rows[0]["prompt"], 1), [rows[0]["image"]], seed=7)
    (choice,) = response.choices
    assert choice.token_ids == direct.response_ids.tolist()
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(direct.logprobs.tolist(), abs=1e-5)
    assert response.usage.prompt_tokens == len(response.prompt_token_ids)  # the prompt as sent: one placeholder
    # an episode's second call sends the conversation again, image included: it continues the first call's tokens
    record = server.open_episode(None, trained=False)
    # plain letters only: the random model's special tokens are not in the text a reply returns, so sent back they
    # would not continue its tokens
    body["allowed_token_ids"] = tokenizer.convert_tokens_to_ids(list("abcdefgh ")) + [tokenizer.eos_token_id]
    first = loop.run_until_complete(server.chat_completion(record, body))
    again = [*body["messages"], {"role": "assistant", "content": first.choices[0].message.content}]
    again.append({"role": "user", "content": "Are you sure?"})
    second = loop.run_until_complete(server.chat_completion(record, {**body, "messages": again}))
    assert record.calls == 2 and record.splits == 0 and record.failure is None
    assert second.prompt_token_ids[: len(first.prompt_token_ids)] == first.prompt_token_ids


@pytest.mark.parametrize("posed", [False, True], ids=["row-image", "posed-at-reset"])
def test_a_multi_turn_environment_shows_an_image_and_the_trajectory_keeps_exact_tokens(
    generator, processor, rows, transformers_model, posed
):
    """An environment whose step shows an image (`EnvStep.images`): the model's next turn is sampled with the
    prompt's image (the row's, or one the environment posed at reset with its own question) and the environment's;
    the trajectory holds the engine's ids (both images expanded, the environment's masked) and both images, and
    transformers on those ids and pixels computes the behaviour logprobs of every model token of both turns."""
    import torch

    from forge_rl.data.images import load_image
    from forge_rl.data.task import TaskConfig, TaskRows, render
    from forge_rl.deps.transformers import auto_tokenizer
    from forge_rl.envs.base import EnvConfig, Environment, EnvStep
    from forge_rl.loop.multiturn import play_group
    from forge_rl.loop.turn_renderer import TurnRenderer
    from forge_rl.models.build_tiny_vlm import IMAGE_TOKEN_ID, IMAGE_TOKENS

    class ShowsAnImage(Environment):
        shown = False

        async def reset(self, example):
            if posed:  # the environment's own question about its own image, in place of the row's
                return EnvStep(messages=[{"role": "user", "content": "Add <image>."}], images=[rows[1]["image"]])
            return None

        async def step(self, reply):
            if self.shown:
                return EnvStep(reward=1.0, done=True, solved=True)
            self.shown = True
            return EnvStep(messages=[{"role": "user", "content": "And this one? <image>"}], images=[rows[2]["image"]])

    loop, svc = generator
    tokenizer = auto_tokenizer(resolve_model_path("tiny-vlm"))
    task = TaskConfig(source="digit_sum").resolved()
    example = TaskRows(task, seed=0).next()
    example = dataclasses.replace(example, text=render(tokenizer, example, task))
    prompt_ids = tokenizer(example.text, add_special_tokens=False)["input_ids"]
    env_cfg = EnvConfig(max_turns=2, max_total_tokens=128)
    played = play_group(
        example, prompt_ids, svc, ShowsAnImage, TurnRenderer(tokenizer), env_cfg, 2, MAX_TOKENS, temperature=1.0, seed=1
    )
    for trajectory in loop.run_until_complete(played):
        c = trajectory.completion
        first_image = rows[1]["image"] if posed else example.images[0]
        assert trajectory.turns == 2 and c.images == (first_image, rows[2]["image"])
        ids = torch.cat([c.prompt_ids, c.response_ids])
        # the row's image in the prompt, the environment's in its (masked) tokens; the random model's own turns are
        # seeded to hold no image token (transformers would take one for a third image)
        in_prompt, from_env = (
            (c.prompt_ids == IMAGE_TOKEN_ID).sum(),
            (c.response_ids[c.env_mask] == IMAGE_TOKEN_ID).sum(),
        )
        assert in_prompt == from_env == IMAGE_TOKENS and (c.response_ids[~c.env_mask] != IMAGE_TOKEN_ID).all()
        pixels = processor(
            text=[prompt_of(processor, "<image><image>", 2)],
            images=[[load_image(i, "test") for i in c.images]],
            return_tensors="pt",
        )
        with torch.no_grad():
            logits = transformers_model(
                input_ids=ids[None],
                attention_mask=torch.ones_like(ids[None]),
                pixel_values=pixels["pixel_values"],
                pixel_attention_mask=pixels["pixel_attention_mask"],
            ).logits[0]
        P = len(c.prompt_ids)
        reference = torch.log_softmax(logits, dim=-1)[P - 1 : -1].gather(-1, c.response_ids[:, None])[:, 0]
        model = ~c.env_mask
        assert model.sum() >= 2 and (reference[model] - c.logprobs[model]).abs().max() < 1e-4  # both turns


def test_the_trainer_scores_image_rows_as_the_engine_and_a_frozen_tower_stays_out_of_the_push(
    generator, processor, rows, tmp_path
):
    """The trainer's vision-language model (TorchTitan's decoder behind transformers' Idefics3 tower, FSDP2 over 2
    ranks) computes the engine's behaviour logprobs of image rows (of two images and of one) within the fp32 bound.
    A step with trainer.freeze=[vision] trains the language model only, and its push holds the language model's
    tensors only: the engine updated to it, with image requests in flight, keeps its tower and scores as the trainer
    does again."""
    from forge_rl.actors.trainer import Trainer
    from forge_rl.actors.trainer_config import OptimizerConfig, ParallelConfig, TrainerConfig
    from forge_rl.runtime.actor import stop_actor
    from forge_rl.types import Episode, TrainBatch
    from forge_rl.weights import ShmWeightStore

    loop, svc = generator
    two = prompt_of(processor, "Add <image> and <image>.", 2)
    one = prompt_of(processor, rows[2]["prompt"], 1)

    def sampled():
        group = generate(generator, two, [rows[0]["image"], rows[1]["image"]], n=4, seed=3)
        group += generate(generator, one, [rows[2]["image"]], n=4, seed=4)
        episodes = [Episode(c, reward=0.0, advantage=(-1.0) ** i) for i, c in enumerate(group)]
        return [TrainBatch.collate(episodes[r::2], pad_id=0) for r in range(2)]

    def gap(trainer, batch):
        logprobs = loop.run_until_complete(trainer.logprobs.call(batch)).item(procs=0)
        return float(((logprobs - batch.behaviour_logprobs).abs() * batch.response_mask).max())

    cfg = TrainerConfig(
        model="tiny-vlm",
        parallel=ParallelConfig(dp_shard=2),
        optim=OptimizerConfig(lr=1e-2, warmup_steps=0),
        checkpoint_dir=str(tmp_path / "ckpt"),
        freeze=["vision"],
        micro_batch_size=2,  # each rank's rows of two images, then its rows of one
    )
    trainer = loop.run_until_complete(Trainer.options(procs=2, spmd=True).as_actor(cfg))
    store = ShmWeightStore()
    try:
        batches = sampled()
        assert all(b.images and len(b.images) == 4 for b in batches)
        assert max(gap(trainer, b) for b in batches) < 1e-4
        metrics = loop.run_until_complete(trainer.step.call(batches)).item(procs=0)
        assert metrics["grad_norm"] > 0
        assert gap(trainer, batches[0]) > 1e-3  # the step moved the language model
        loop.run_until_complete(trainer.push_weights.call(1))
        published = store.load(1)
        assert "model.text_model.embed_tokens.weight" in published and "lm_head.weight" in published
        assert not any(k.startswith(("model.vision_model.", "model.connector.")) for k in published)
        # the swap meets image requests in flight: a vision-language engine drains them (its recompute_kv swap
        # loses their encoder outputs in vLLM 0.32) and none ends without tokens
        in_flight = [
            loop.create_task(svc.generate.route(one, images=[rows[2]["image"]], n=4, temperature=1.0, max_tokens=40))
            for _ in range(3)
        ]
        record = loop.run_until_complete(svc.update_weights.call_all(1, mode="recompute_kv"))[0]
        assert record["mode"] == "drain" and record["version"] == 1
        groups = loop.run_until_complete(asyncio.gather(*in_flight))
        assert all(len(c.response_ids) > 0 for group in groups for c in group)
        assert max(gap(trainer, b) for b in sampled()) < 1e-4  # the engine's tower is the checkpoint's: frozen
    finally:
        store.close()
        loop.run_until_complete(stop_actor(trainer))
