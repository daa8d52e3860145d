"""A Generator's image prompts: the images of one `generate` call checked against its prompt and the model, and
turned into vLLM's multimodal input.

A prompt holds the model's image token once per image (the chat template's placeholder, e.g. Idefics3's
`<image>`); the engine's processor expands each into the image's tokens, so the prompt ids the Completion records
are the engine's expanded ids, the ones the trainer must score. Refused here, in one line, before the engine sees
the request: images given to a text-only model, and a placeholder count that is not the number of images.

Each Completion keeps the images as encoded bytes (`Completion.images`, what a trainer scores its image tokens
with): image bytes as given, anything else (a path, a PIL image) encoded as PNG once here.
"""

from typing import Any

from forge_rl.data.images import DEFAULT_MAX_PIXELS, encode_png, load_image
from forge_rl.data.vision import image_token_id, model_config


def image_engine_args(model: str) -> dict[str, Any]:
    """The engine arguments a vision-language model's generator adds (none for a text model). A weight swap clears
    vLLM's multimodal input cache on both sides of the engine, at two moments; a request added in between arrives
    without its image and ends with no tokens. Prompts' images are small next to their decoding: none is cached
    (the generator's engine_args can still set one)."""
    return {"mm_processor_cache_gb": 0} if image_token_id(model_config(model)) is not None else {}


def image_inputs(
    prompt_ids: list[int], images: list[Any], image_token: int | None, model: str, max_pixels: int = DEFAULT_MAX_PIXELS
) -> dict[str, Any]:
    """vLLM's `multi_modal_data` of a prompt and its images (PNG or other image bytes, paths, PIL images), each at
    most `max_pixels` (the model's processor's limit), with the images as the Completions record them ("recorded":
    a tuple of encoded bytes)."""
    if image_token is None:
        raise ValueError(
            f"generate was given {len(images)} images, but the generator's model {model} is text-only "
            "(its config.json has no image token); give a vision-language model"
        )
    found = prompt_ids.count(image_token)
    if found != len(images):
        more = "more" if found > len(images) else "fewer"
        raise ValueError(
            f"the prompt holds {found} image placeholders (token {image_token}), {more} than its {len(images)} images"
        )
    loaded = [load_image(image, f"image {i} of the prompt", max_pixels) for i, image in enumerate(images)]
    recorded = tuple(bytes(i) if isinstance(i, (bytes, bytearray)) else encode_png(p) for i, p in zip(images, loaded))
    return {"image": loaded, "recorded": recorded}


async def prefill_once(engine, prompt_ids: list[int], images: dict[str, Any], request_id: str, adapter) -> None:
    """Run an image prompt once (one greedy token, thrown away) so that its full blocks are in the engine's prefix
    cache before a group's samples start. vLLM schedules the prefills of a request's n samples in one engine step,
    before any of their blocks is cached: without this, a group of an image not seen before computes its prompt,
    and its image through the vision encoder, once per sample. A prompt already cached costs one decode step."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=prompt_ids, multi_modal_data={"image": images["image"]})
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    async for _ in engine.generate(prompt, params, request_id, lora_request=adapter):
        pass
