"""What a Generator counts and reports (its `stats` endpoint): tokens generated, prompt tokens and those the engine's
prefix cache held, the time it generated, how full its engine's batches were, its weight updates' costs, and the
bytes of what it records per token. A mixin of Generator (forge_rl/actors/generator.py).

Time is accounted at every change of state (`_tick`): a request entering or leaving the engine, a sequence finishing,
a hold or a release. The generator is busy while requests are in the engine and it is not held; held time with
requests waiting is the other role's (colocated placement), not generation.
"""

import os
import time


class GeneratorStats:
    """Generator's counters: needs self.engine, store, policy_version, updates and _held_since
    (forge_rl/actors/generator_weights.py), _in_flight."""

    def _init_stats(self) -> None:
        self._kept_bytes = self._kept_tokens = 0  # recorded kept sets, and the response tokens they are of
        self._routes_bytes = self._routes_positions = 0  # recorded routes, and the positions they are of
        self._generated_tokens = 0
        # prompt tokens of every sequence started (a group of G counts its prompt G times), and of those the ones
        # the engine's prefix cache held (the full blocks of a prompt run before, its images in the blocks' keys)
        self._prompt_tokens = self._prompt_tokens_cached = 0
        self._busy_s = 0.0  # wall time with at least one request in the engine, not held for another role
        self._active = 0
        self._max_active = 0  # most requests in the engine at once (shows that calls overlap)
        self._sequences = 0  # sequences in the engine (a request of n completions is n until each finishes)
        self._sequence_s = 0.0  # integral of _sequences over busy time: / _busy_s = the mean batch occupancy
        self.aborted_too_old = 0  # requests aborted for their max_age, ever
        self._since = time.perf_counter()  # last change of _active or _held_since
        self._held_s = 0.0

    def _stats(self) -> dict[str, float]:
        self._tick()
        return dict(
            generated_tokens=self._generated_tokens,
            prompt_tokens=self._prompt_tokens,
            prompt_tokens_cached=self._prompt_tokens_cached,
            busy_s=self._busy_s,  # requests in the engine and not held: the time it generated
            held_s=self._held_s,  # paused for another role (colocated)
            max_concurrent_requests=self._max_active,
            # sequences in the engine (running or queued) over the time it generated: its mean batch occupancy
            sequence_s=self._sequence_s,
            running_sequences=self._sequences,
            mean_running_sequences=self._sequence_s / self._busy_s if self._busy_s else 0.0,
            aborted_too_old=self.aborted_too_old,
            unfinished_requests=self.engine.get_num_unfinished_requests(),
            tokens_generated_in_flight=sum(len(c.ids) for _, cs in self._in_flight.values() for c in cs),
            weight_updates=len(self.updates),
            pause_s_total=sum(u["pause_s"] for u in self.updates),
            drain_wait_s_total=sum(u["drain_wait_s"] for u in self.updates),
            # prompt + generated tokens whose KV cache a recompute_kv swap threw away (recomputed by the new weights)
            recomputed_tokens_total=sum(u["tokens_in_flight"] for u in self.updates if u["mode"] == "recompute_kv"),
            prefetch_s_total=sum(u["prefetch_s"] for u in self.updates),
            # over Monarch RDMA (forge_rl/weights/rdma.py); a judge (policy_weights=False) has no store
            weights_fetched_from_other_host=self.store.remote_fetches if self.store is not None else 0,
            policy_version=self.policy_version,
            pid=os.getpid(),
            tokens_per_s=self._generated_tokens / self._busy_s if self._busy_s else 0.0,
            # Keep Sampling Mask: bytes of the kept sets recorded per response token they are of (CSR, int32)
            sampling_mask_bytes_per_token=self._kept_bytes / self._kept_tokens if self._kept_tokens else 0.0,
            # Keep Routing: bytes of the recorded experts per position they are of (layers x top-k x 1 or 2)
            routes_bytes_per_token=self._routes_bytes / self._routes_positions if self._routes_positions else 0.0,
        )

    def _count_completion(self, child) -> None:
        """A completion handed back: its tokens, and the bytes of its kept sets when it recorded every token's."""
        self._generated_tokens += len(child.ids)
        if child.cap is not None and not child.over_cap:
            self._kept_bytes += 4 * (len(child.kept_ids) + len(child.kept_offsets))
            self._kept_tokens += len(child.ids)

    def _count_prompt(self, prompt_len: int, cached: int | None) -> None:
        """A sequence's prompt, as the engine started it: its length and the tokens its prefix cache held."""
        self._prompt_tokens += prompt_len
        self._prompt_tokens_cached += cached or 0

    def _count_routes(self, routes) -> None:
        """Keep Routing: the bytes of a completion's recorded experts, and the positions they are of."""
        self._routes_bytes += routes.nbytes
        self._routes_positions += len(routes)

    def _tick(self) -> None:
        """Account the time since the last change of state: generating if requests were in the engine and
        it was not held (held time with requests waiting is the other role's, not generation)."""
        now = time.perf_counter()
        if self._active and self._held_since is None:
            self._busy_s += now - self._since
            self._sequence_s += self._sequences * (now - self._since)
        self._since = now

    def _enter(self, sequences: int) -> None:
        self._tick()
        self._active += 1
        self._sequences += sequences
        self._max_active = max(self._max_active, self._active)

    def _sequence_done(self) -> None:
        self._tick()
        self._sequences -= 1

    def _leave(self, unfinished: int) -> None:
        """A request left the engine; `unfinished`: its sequences that never finished (aborted, timed out)."""
        self._tick()
        self._active -= 1
        self._sequences -= unfinished
