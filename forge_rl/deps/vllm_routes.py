"""Keep Routing's engine side: the experts vLLM 0.32's engine routed each token to, recorded by a worker extension.

vLLM returns routed experts itself (`enable_return_routed_experts`) only under its Model Runner V2, which its CPU
build lacks ("AuxOutput Connector requires Model Runner V2"). `RouteRecorder` records the same thing in any V1
worker (CPU included), through vLLM's own capture point: every modular MoE router (`BaseRouter`) calls a
`capture_fn` with the logical top-k expert ids it chose, before any expert-parallel remapping. The model runner's
input batch says whose tokens those rows are (`input_batch.req_ids`, `query_start_loc`) and at which positions
(`positions`), so each row lands at (request, position, layer); a position computed again (a `recompute_kv` swap,
a preemption) is overwritten by its newest routing, which is the one the request's KV cache holds.

A request's record covers every position the engine ran through the model, prompt included: positions 0 to
prompt + response - 2 (the last sampled token is never fed back). Prefix caching would skip the prompt positions
another request computed, so the generator turns it off while recording (generator.py).

Names used from vLLM (private, 0.32): `MoERunner` (its `router`, `layer_id`, `routed_experts.quant_method`),
`BaseRouter.set_capture_fn`, the V1 model runner's `input_batch.req_ids`, `query_start_loc.np`, `positions`; and the
engine's request ids: AsyncLLM makes `<id>-<8 random>` of a request id, and `<i>_<that>` for completion i of n > 1.
"""

import numpy as np

NOT_RECORDED = -1  # a position the engine never ran (or a layer it did not route) in a request's record


class RouteRecorder:
    """Mixed into vLLM's worker (worker_extension_cls, with forge_rl.deps.vllm.MoEWeightReload):
    `forge_rl_record_routes` starts recording, `forge_rl_take_routes` hands over a finished request's record."""

    def forge_rl_record_routes(self) -> tuple[int, int]:
        """Bind a recorder to every MoE router of the model. Returns (MoE layers, top-k); (0, 0): no MoE layer."""
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        runners = [m for m in self.model_runner.get_model().modules() if isinstance(m, MoERunner)]
        if not runners:
            return 0, 0
        for runner in runners:
            if runner.is_monolithic or not isinstance(runner.router, BaseRouter):
                raise ValueError(
                    f"MoE layer {runner.layer_id}: its kernel routes inside itself "
                    f"({type(runner.routed_experts.quant_method).__name__}); forge_rl records routes "
                    "from vLLM's modular routers only"
                )
        layers = sorted(r.layer_id for r in runners)
        self._forge_rl_routes = _Routes(
            n_layers=max(layers) + 1, top_k=runners[0].router.top_k, runner=self.model_runner
        )
        for runner in runners:
            runner.router.set_capture_fn(self._forge_rl_routes.capture_fn(runner.layer_id))
        return len(layers), runners[0].router.top_k

    def forge_rl_take_routes(self, request_id: str) -> list[tuple[int, tuple[int, ...], bytes]]:
        """The records of request `request_id` (the id given to AsyncLLM.generate), removed from the recorder:
        (completion index, shape, bytes) of each one's int16 [positions, layers, top-k] array (NOT_RECORDED where
        the engine ran none). Raw bytes: the engine's RPC would send an array as nested lists."""
        routes = getattr(self, "_forge_rl_routes", None)
        taken = {} if routes is None else routes.take(request_id)
        return [(index, record.shape, record.tobytes()) for index, record in sorted(taken.items())]


def routes_from_rpc(taken: list) -> dict[int, np.ndarray]:
    """forge_rl_take_routes' answer as completion index -> int16 [positions, layers, top-k]."""
    return {int(index): np.frombuffer(data, dtype=np.int16).reshape(tuple(shape)) for index, shape, data in taken}


class _Routes:
    def __init__(self, n_layers: int, top_k: int, runner):
        self.n_layers, self.top_k, self.runner = n_layers, top_k, runner
        self.records: dict[str, np.ndarray] = {}  # engine request id -> int16 [capacity, layers, top-k]
        # this forward's layout, made at its first MoE layer: request ids, their row spans, each row's position, and
        # that layer (when it comes around again, a new forward has begun)
        self.step: tuple[list, np.ndarray, np.ndarray, int] | None = None

    def capture_fn(self, layer: int):
        def capture(topk_ids) -> None:
            self.capture(layer, topk_ids)

        return capture

    def capture(self, layer: int, topk_ids) -> None:
        ids = topk_ids.detach().to("cpu").numpy()
        if self.step is None or self.step[3] == layer:  # a new forward (its first MoE layer comes around again)
            self.step = self._layout(len(ids), layer)
        req_ids, starts, positions, _ = self.step
        for i, req_id in enumerate(req_ids):
            lo, hi = starts[i], starts[i + 1]
            if hi > lo:
                record = self._record(req_id, int(positions[hi - 1]) + 1)
                record[positions[lo:hi], layer] = ids[lo:hi]

    def _layout(self, n_rows: int, first_layer: int):
        """Whose rows this forward holds: request ids, their row spans and each row's position."""
        runner = self.runner
        req_ids = [r for r in runner.input_batch.req_ids if r is not None]
        starts = np.asarray(runner.query_start_loc.np[: len(req_ids) + 1], dtype=np.int64)
        positions = runner.positions[:n_rows].detach().to("cpu").numpy().astype(np.int64)
        return req_ids, starts, positions, first_layer

    def _record(self, req_id: str, length: int) -> np.ndarray:
        record = self.records.get(req_id)
        if record is None or len(record) < length:
            grown = np.full(
                (max(length, 2 * len(record) if record is not None else 64), self.n_layers, self.top_k),
                NOT_RECORDED,
                dtype=np.int16,
            )
            if record is not None:
                grown[: len(record)] = record
            self.records[req_id] = record = grown
        return record

    def take(self, request_id: str) -> dict[int, np.ndarray]:
        out = {}
        for engine_id in [k for k in self.records if _external_id(k) == request_id]:
            record = self.records.pop(engine_id)
            ran = np.flatnonzero((record != NOT_RECORDED).any(axis=(1, 2)))
            out[_completion_index(engine_id)] = record[: ran[-1] + 1 if len(ran) else 0]
        return out


def _external_id(engine_id: str) -> str:
    """The id given to AsyncLLM.generate of an engine request id (`[<i>_]<id>-<8 random>`)."""
    head, _, _ = engine_id.rpartition("-")
    index, sep, rest = head.partition("_")
    return rest if sep and index.isdigit() else head


def _completion_index(engine_id: str) -> int:
    index, sep, _ = engine_id.partition("_")
    return int(index) if sep and index.isdigit() else 0
