"""Keep Routing on the embedded tiny-moe (Qwen3-MoE, 4 MoE layers, 4 experts, top 2): the generator records the
experts vLLM's engine routed every position to (the same as transformers' routers on the same sequence, fp32); the
trainer's routers replay them, so the expert layers receive the engine's experts while the router still learns;
routes travel through completions, batches, prompt packing and multi-turn trajectories. The engine's record against
transformers' routers is tests/integration/test_keep_routing_engine.py's; the GRPO run that trains with them (sync,
fp32, expert parallel, with a reference) is tests/integration/test_moe_grpo.py's."""

import numpy as np
import pytest
import torch

from forge_rl.models import resolve_model_path
from forge_rl.types import Completion, Episode, TrainBatch

TINY_MOE = resolve_model_path("tiny-moe")
LAYERS, TOP_K = 4, 2


def test_replayed_routes_are_the_experts_the_expert_layers_receive_and_the_router_still_learns():
    from forge_rl.models.qwen3 import build_model
    from forge_rl.models.route_replay import RouteReplay

    model, _ = build_model(TINY_MOE)
    replay = RouteReplay(model)
    own: dict[int, torch.Tensor] = {}
    for layer, router in enumerate(replay.routers):
        router.register_forward_hook(lambda m, i, out, layer=layer: own.__setitem__(layer, out[1].detach()))
    tokens = torch.randint(3, 99, (2, 12), generator=torch.Generator().manual_seed(0))
    free = model(tokens).detach()
    routes = torch.stack([own[layer] for layer in range(LAYERS)], 2).to(torch.int16)  # [B, T, layers, top-k]
    routes[:, -1] = -1  # a position without a record routes freely
    replay.set(routes)
    assert torch.equal(model(tokens).detach(), free)  # the router's own choice replayed: the same function
    assert replay.stats().tolist() == [2 * 11 * LAYERS, 0, 2 * 11 * LAYERS]
    # other experts for row 0 from position 6 on, in layer 1: the outputs before it, and row 1's, are untouched (to
    # rounding: the experts' matmuls see other numbers of tokens)
    forced = routes.clone()
    forced[0, 6:11, 1] = (own[1][0, 6:11].sort(-1).values + 2) % 4  # the two experts it did not choose
    replay.set(forced)
    out = model(tokens)
    assert torch.allclose(out[0, :6], free[0, :6], atol=1e-5) and torch.allclose(out[1], free[1], atol=1e-5)
    assert (out[0, 6:11].detach() - free[0, 6:11]).abs().max() > 1e-3
    assert torch.equal(own[1][0, 6:11].sort(-1).values, forced[0, 6:11, 1].long().sort(-1).values)  # used as given
    assert replay.stats().tolist() == [2 * 11 * LAYERS, 5, 2 * 11 * LAYERS]
    out.float().square().mean().backward()  # weights from the router's scores over the given experts: it learns
    assert all(r.gate.weight.grad is not None and r.gate.weight.grad.abs().sum() > 0 for r in replay.routers)
    replay.set(None)
    assert torch.equal(model(tokens).detach(), free)


def test_the_load_balancing_loss_counts_the_replayed_experts():
    """Under replay the balancing loss's f counts the experts the tokens went to (the engine's), its P is the
    router's own probabilities: defined, and it still reaches every router."""
    from forge_rl.models.moe_aux import RouterStats
    from forge_rl.models.qwen3 import build_model
    from forge_rl.models.route_replay import RouteReplay

    model, _ = build_model(TINY_MOE)
    replay, stats = RouteReplay(model), RouterStats(model.train())
    tokens = torch.randint(3, 99, (2, 8), generator=torch.Generator().manual_seed(1))
    routes = torch.zeros(2, 8, LAYERS, TOP_K, dtype=torch.int16)
    routes[..., 1] = 1  # every token to experts 0 and 1
    replay.set(routes)
    model(tokens)
    assert all(torch.equal(ids.sort(-1).values, routes[:, :, 0].long()) for _, ids in stats.records)
    probs = torch.stack([scores.detach() for scores, _ in stats.records]).reshape(-1, 4).mean(0)  # P_e
    aux = stats.pop_loss()
    assert aux.item() == pytest.approx(4 * (probs[0] + probs[1]).item(), rel=1e-5)  # E x (f_0 P_0 + f_1 P_1), f = 1
    aux.backward()
    assert all(r.gate.weight.grad is not None and r.gate.weight.grad.abs().sum() > 0 for r in replay.routers)


def _completion(prompt: list[int], response: list[int], routes: torch.Tensor | None) -> Completion:
    n = len(response)
    return Completion(
        torch.tensor(prompt),
        torch.tensor(response),
        torch.zeros(n),
        torch.zeros(n, dtype=torch.long),
        "stop",
        routes=routes,
    )


def _routes(positions: int, seed: int) -> torch.Tensor:
    return torch.randint(
        0, 4, (positions, LAYERS, TOP_K), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8
    )


def test_routes_travel_in_completions_batches_and_packed_rows():
    from forge_rl.data.prompt_packing import plan_packing
    from forge_rl.models.route_replay import packed_routes

    with pytest.raises(ValueError, match=r"Completion.routes must be \[prompt \+ response - 1 = 6, layers, top-k\]"):
        _completion([1, 2, 3], [4, 5, 6, 7], _routes(7, 0))
    a = _completion([1, 2, 3], [4, 5, 6, 7], _routes(6, 1))
    b = _completion([1, 2, 3], [8, 9], _routes(4, 2))
    restored = Completion.__new__(Completion)
    restored.__setstate__(a.__getstate__())  # across Monarch, the buffer and checkpoints (numpy on the wire)
    assert torch.equal(restored.routes, a.routes) and a.routes_bytes == 6 * LAYERS * TOP_K
    batch = TrainBatch.collate([Episode(a, advantage=1.0), Episode(b, advantage=-1.0)], pad_id=0)
    assert batch.routes.dtype == torch.int16 and tuple(batch.routes.shape) == (2, 7, LAYERS, TOP_K)
    assert torch.equal(batch.routes[0, :6], a.routes.short()) and (batch.routes[0, 6] == -1).all()
    assert torch.equal(batch.routes[1, :4], b.routes.short()) and (batch.routes[1, 4:] == -1).all()
    packed = plan_packing(batch.tokens, batch.response_mask, max_fraction=1.0)  # [1, 2, 3 | 4 5 6 7 | 8 9]
    routes = packed_routes(batch.routes, packed.source)
    assert tuple(routes.shape) == (1, 9, LAYERS, TOP_K)
    assert torch.equal(routes[0, :7], batch.routes[0, :7])  # the prompt once (row 0's), then a's response
    assert torch.equal(routes[0, 7:9], batch.routes[1, 3:5])  # b's response, its last token without a record
    assert TrainBatch.collate([Episode(_completion([1], [2], None), advantage=0.0)], pad_id=0).routes is None


def test_routes_survive_the_replay_buffer_and_its_checkpoint(tmp_path):
    from forge_rl.actors.replay_buffer import GroupStore
    from forge_rl.actors.replay_buffer_config import ReplayBufferConfig
    from forge_rl.types import Group

    a, b = _completion([1, 2, 3], [4, 5], _routes(4, 5)), _completion([1, 2, 3], [6], _routes(3, 6))
    store = GroupStore(ReplayBufferConfig(capacity=2))
    store.add(Group("p", [Episode(a, advantage=1.0), Episode(b, advantage=-1.0)]))
    torch.save(store.state_dict(), tmp_path / "app_state.pt")  # as save_checkpoint writes the buffer's groups
    restored = GroupStore(ReplayBufferConfig(capacity=2))
    restored.load_state_dict(torch.load(tmp_path / "app_state.pt", weights_only=False))
    batch = restored.sample(0, 1)[0]
    assert torch.equal(batch.routes[0, :4], a.routes.short()) and torch.equal(batch.routes[1, :3], b.routes.short())


def test_a_multi_turn_trajectory_keeps_each_positions_first_routing():
    from forge_rl.loop.multiturn import TurnRoutes

    first = _completion([1, 2], [3, 4], _routes(3, 3))  # ran positions 0-2
    second = _completion([1, 2, 3, 4, 9, 9], [5, 6], _routes(7, 4))  # the environment's 9s, then 5 6: ran 0-6
    routes = TurnRoutes()
    routes.add_turn(first)
    routes.add_turn(second)
    kept = routes.fields()["routes"]
    assert torch.equal(kept, torch.cat([first.routes, second.routes[3:]]))
    _completion([1, 2], [3, 4, 9, 9, 5, 6], kept)  # the trajectory's completion takes them
    unrecorded = TurnRoutes()
    unrecorded.add_turn(first)
    unrecorded.add_turn(_completion([1, 2, 3, 4], [5], None))
    assert unrecorded.fields() == {}


def test_the_engines_request_ids_map_back_to_the_callers():
    from forge_rl.deps.vllm_routes import _completion_index, _external_id, routes_from_rpc

    assert _external_id("123-7-0a1b2c3d") == "123-7" and _completion_index("123-7-0a1b2c3d") == 0
    assert _external_id("3_123-7-0a1b2c3d") == "123-7" and _completion_index("3_123-7-0a1b2c3d") == 3
    record = np.arange(2 * LAYERS * TOP_K, dtype=np.int16).reshape(2, LAYERS, TOP_K)
    assert np.array_equal(routes_from_rpc([(1, record.shape, record.tobytes())])[1], record)


def test_a_batch_without_the_routes_keep_routing_needs_is_refused_by_name():
    from forge_rl.actors.batch_checks import validate_batches
    from tests.integration.test_trainer import make_batch

    batch = make_batch(0, B=2, T=12)
    with pytest.raises(ValueError, match=r"batch\[0\] has no routes .* trainer.keep_routing is on"):
        validate_batches([batch], 1, 128, 64, routing=(LAYERS, TOP_K, 4))
    batch.routes = torch.zeros(2, 12, LAYERS, 1, dtype=torch.int16)
    with pytest.raises(ValueError, match=r"batch\[0\].routes has shape \(2, 12, 4, 1\), expected \(2, 12, 4, 2\)"):
        validate_batches([batch], 1, 128, 64, routing=(LAYERS, TOP_K, 4))
    batch.routes = torch.full((2, 12, LAYERS, TOP_K), 4, dtype=torch.int16)
    with pytest.raises(ValueError, match=r"expert ids outside \[0, 4\)"):
        validate_batches([batch], 1, 128, 64, routing=(LAYERS, TOP_K, 4))
    batch.routes[:] = -1
    validate_batches([batch], 1, 128, 64, routing=(LAYERS, TOP_K, 4))


def test_vllms_own_routed_experts_become_the_same_record():
    """A GPU engine under Model Runner V2 returns the routes itself (CompletionOutput.routed_experts, on the final
    delta): the generator keeps them as the CPU recorder's, and a record missing a position fails by name."""
    from vllm.outputs import CompletionOutput, WeightVersionSpan

    from forge_rl.actors.generator_outputs import Child, completion_routes

    engine = np.random.default_rng(0).integers(0, 4, (3 + 4 - 1, LAYERS, TOP_K)).astype(np.uint8)
    child = Child()
    child.extend(CompletionOutput(0, "", [7, 8], None, None))
    child.extend(
        CompletionOutput(
            0,
            "",
            [9, 2],
            None,
            None,
            routed_experts=engine,
            finish_reason="stop",
            weight_versions=[WeightVersionSpan("0", 0, 4)],
        )
    )
    routes = completion_routes(child, prompt_len=3, dtype=torch.uint8)
    assert routes.dtype == torch.uint8 and torch.equal(routes, torch.from_numpy(engine))
    _completion([1, 2, 3], [7, 8, 9, 2], routes)  # the shape Completion takes
    child.routes = engine[:4]
    with pytest.raises(RuntimeError, match="the engine recorded 4 positions of the 6 positions of a completion"):
        completion_routes(child, prompt_len=3, dtype=torch.uint8)


def test_engine_arguments_that_would_lose_routes_are_refused_by_name():
    from forge_rl.actors.generator_engine import route_engine_args
    from forge_rl.config import ConfigError

    assert route_engine_args(True, {}, "generator.engine_args") == dict(enable_return_routed_experts=True)
    assert route_engine_args(False, {}, "generator.engine_args") == dict(enable_prefix_caching=False)
    with pytest.raises(ConfigError, match="generator.engine_args.enable_prefix_caching=true with trainer.keep_routing"):
        route_engine_args(False, dict(enable_prefix_caching=True), "generator.engine_args")
    with pytest.raises(
        ConfigError, match="generator.engine_args.worker_extension_cls='my.Ext' with trainer.keep_routing"
    ):
        route_engine_args(False, dict(worker_extension_cls="my.Ext"), "generator.engine_args")
