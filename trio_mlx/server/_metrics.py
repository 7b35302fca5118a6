"""Prometheus metrics of one app, served at `GET /metrics` (prometheus_client exposition).

Two sources, neither of which costs anything per token:
- per request: `Metrics.observe` is an app observer (`app.observers`) that
  gets each completion request's `RequestRecord` once, when it ends; other
  routes are counted once per response (`observe_route`);
- per scrape: `_EngineCollector` reads `engine.statistics()` (queue, stages,
  decode steps, aborts, the prompt cache, MLX memory, state) when /metrics is
  fetched; with `--models`, each loaded model's, labelled by model.

Every app has its own `CollectorRegistry`, never prometheus_client's global
one, so several apps in one process (tests) do not collide.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

from ._records import RequestRecord, ServerHost

PREFIX = "trio_mlx_"
STATES = ("starting", "ready", "restarting", "draining", "closed", "broken")
STAGES = ("queued", "prefill", "decode")
# The causes the engine counts (EngineStatistics.aborts_by_cause), listed so each series
# exists at 0 before its first abort (a rate() over a series that appears later misses it).
CAUSES = ("cancelled", "disconnect", "stall", "stop_string", "shutdown", "gone")
# RequestRecord.outcome's values, pre-created for the completion endpoints (same reason).
OUTCOMES = ("ok", "error", "disconnect", "stall", "cancelled", "aborted", "failed")

# Bucket bounds (seconds): arbitrary, chosen to span a tiny CPU model and a large GPU one.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class Metrics:
    """The metrics of one app; `render()` is the body of `GET /metrics`."""

    def __init__(self, app: ServerHost, generation_paths: Sequence[str]):
        """`generation_paths`: the endpoints whose outcomes are counted from the start, at 0
        (the route table's generating ones, `_routes.GENERATION_PATHS`)."""
        self.registry = reg = CollectorRegistry()
        self.requests = Counter(PREFIX + "requests", "HTTP requests answered, by endpoint and status "
                                "(status 'none': the client left before any response)",
                                ["endpoint", "status"], registry=reg)
        self.outcomes = Counter(PREFIX + "request_outcomes", "completion requests by how they ended: ok, "
                                "error (refused before generating), disconnect, stall, cancelled, "
                                "aborted (shutdown), failed (the engine or server failed mid-way)",
                                ["endpoint", "outcome"], registry=reg)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "arrival to the first token sent",
                              ["endpoint"], buckets=TTFT_BUCKETS, registry=reg)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds", "mean time between tokens after "
                              "the first, per completed request", ["endpoint"], buckets=TPOT_BUCKETS,
                              registry=reg)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "arrival to the end of the "
                             "response, per completed request", ["endpoint"], buckets=E2E_BUCKETS,
                             registry=reg)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "prompt tokens of admitted completion "
                                     "requests", ["endpoint"], registry=reg)
        self.completion_tokens = Counter(PREFIX + "completion_tokens", "tokens generated for completed "
                                         "requests", ["endpoint"], registry=reg)
        for endpoint in generation_paths:
            for outcome in OUTCOMES:
                self.outcomes.labels(endpoint, outcome)
        reg.register(_EngineCollector(app))
        ProcessCollector(registry=reg)  # RSS, CPU, open fds (Linux; nothing elsewhere)

    def observe(self, rec: RequestRecord) -> None:
        """An app observer: called once per completion request, when it ends."""
        endpoint = rec.endpoint
        self.requests.labels(endpoint, str(rec.status) if rec.status else "none").inc()
        self.outcomes.labels(endpoint, rec.outcome).inc()
        if rec.admitted is not None:
            self.prompt_tokens.labels(endpoint).inc(rec.prompt_tokens)
        if rec.first_token is not None:
            self.ttft.labels(endpoint).observe(rec.first_token - rec.arrived)
        if rec.outcome != "ok" or rec.ended is None:
            return
        self.completion_tokens.labels(endpoint).inc(rec.completion_tokens)
        self.e2e.labels(endpoint).observe(rec.ended - rec.arrived)
        per_choice = rec.completion_tokens / max(1, rec.n)  # n choices decode side by side
        if rec.first_token is not None and per_choice > 1:
            self.tpot.labels(endpoint).observe((rec.ended - rec.first_token) / (per_choice - 1))

    def observe_route(self, endpoint: str, status: int) -> None:
        """A response from one of the Quart routes (probes, models, metrics, 404s)."""
        self.requests.labels(endpoint, str(status)).inc()

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The exposition and its content type: Prometheus text 0.0.4, or OpenMetrics when the
        scraper's Accept header asks for it."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type


class _EngineCollector:
    """Reads the engine's statistics at scrape time: free between scrapes. With `--models`
    (`app.pool`) every engine figure is one series per loaded model, labelled `model` (an
    unloaded model has none; a model's counters start again at 0 when it loads again); the
    figures of the process as a whole (MLX's memory, the open streams, the state) stay
    unlabelled, MLX's memory as the freshest reading of any loaded model's actor (one
    process's memory: a sum would count it once per model)."""

    def __init__(self, app: ServerHost):
        self.app = app

    def describe(self) -> list[Metric]:
        return []  # no describe-time collect: the engine may not exist yet

    def collect(self) -> Iterator[Metric]:
        engine, pool = self.app.engine, self.app.pool
        keys: list[str] = []  # the label the engine figures carry: none, or "model"
        sources: list[tuple[list[str], Any]] = []  # (label values, statistics), one per engine
        if pool is not None:
            keys = ["model"]
            for name in pool.names:
                if (loaded := pool.engine(name)) is not None:
                    sources.append(([name], loaded.statistics()))
            state = "draining" if pool.closing else "ready"
        else:
            s = engine.statistics() if engine is not None else None
            sources.append(([], s))
            state = s.state if s is not None else "starting"
        family = GaugeMetricFamily(PREFIX + "engine_state", "1 for the engine's current state", labels=["state"])
        for name in STATES:
            family.add_metric([name], 1.0 if name == state else 0.0)
        yield family

        def num(s: Any, attr: str) -> float:
            return float(getattr(s, attr) or 0) if s is not None else 0.0

        def each(kind: type[Any], name: str, doc: str, value: Any) -> Metric:
            """One family, a series per source, of `value(statistics)`."""
            metric = kind(PREFIX + name, doc, labels=keys)
            for labels, s in sources:
                metric.add_metric(labels, value(s))
            return metric

        def gauge(name: str, attr: str, doc: str) -> Metric:
            return each(GaugeMetricFamily, name, doc, lambda s: num(s, attr))

        def counter(name: str, attr: str, doc: str) -> Metric:
            return each(CounterMetricFamily, name, doc, lambda s: num(s, attr))

        stages = GaugeMetricFamily(PREFIX + "requests_in_engine", "requests the engine holds, by stage "
                                   "(queued: waiting for a batch slot)", labels=[*keys, "stage"])
        for labels, s in sources:
            for stage, attr in zip(STAGES, ("queued", "prefilling", "decoding"), strict=True):
                stages.add_metric([*labels, stage], num(s, attr))
        yield stages
        yield gauge("queue_depth", "queued", "requests waiting for a batch slot")
        yield gauge("active_sequences", "active", "sequences the GPU actor holds")
        yield GaugeMetricFamily(PREFIX + "open_streams", "streamed responses being written",
                                value=float(self.app.open_streams()))
        for name, attr, doc in (
            ("engine_requests_submitted", "requests_submitted", "requests handed to the GPU actor"),
            ("engine_requests_finished", "requests_finished", "requests the engine ended (any reason)"),
            ("engine_requests_rejected", "requests_rejected", "requests shed with 429 (never reached the actor)"),
            ("engine_prompt_tokens", "prompt_tokens", "prompt tokens the actor prefilled"),
            ("engine_generated_tokens", "generated_tokens", "tokens the actor generated, aborted requests included"),
            ("decode_steps", "decode_steps", "decode steps that produced tokens"),
            ("step_failures", "step_failures", "sequences ended by a failed generation step"),
            ("actor_restarts", "actor_restarts", "GPU actors started again after one died"),
        ):
            yield counter(name, attr, doc)
        yield each(CounterMetricFamily, "decode_step_seconds", "time spent in decode steps (with "
                   "decode_steps_total: the mean step time)",
                   lambda s: num(s, "mean_step_seconds") * num(s, "decode_steps"))
        yield gauge("decode_step_last_seconds", "last_step_seconds", "the last decode step's time")
        yield gauge("seconds_since_step", "seconds_since_step", "seconds since the actor last stepped while "
                    "work is pending (0 when idle); /health turns 503 past the watchdog")
        for label, attr, known in (("stage", "aborts_by_stage", STAGES), ("cause", "aborts_by_cause", CAUSES)):
            aborts = CounterMetricFamily(PREFIX + f"aborts_by_{label}", f"requests aborted, by {label}",
                                         labels=[*keys, label])
            for labels, s in sources:
                counts: dict[str, int] = dict(getattr(s, attr)) if s is not None else {}
                for key in (*known, *sorted(set(counts) - set(known))):
                    aborts.add_metric([*labels, key], float(counts.get(key, 0)))
            yield aborts
        for name, attr, doc in (
            ("prompt_cache_lookups", "prompt_cache_lookups", "prompts looked up in the prompt cache"),
            ("prompt_cache_hits", "prompt_cache_hits", "lookups that found a cached prefix"),
            ("prompt_cache_hit_tokens", "prompt_cache_hit_tokens", "prompt tokens served from the prompt "
             "cache instead of prefilled"),
            ("prompt_cache_evictions", "prompt_cache_evictions", "prompt cache entries evicted (its byte "
             "bound, memory pressure, a failed step)"),
            ("tokenizer_prefix_hits", "tokenizer_prefix_hits", "chat prompts tokenized only past a recent "
             "prompt they repeat"),
            ("tokenizer_prefix_tokens", "tokenizer_prefix_tokens", "prompt tokens taken from a recent prompt's "
             "ids instead of tokenized again"),
            ("draft_tokens", "draft_tokens", "tokens speculative decoding drafted"),
            ("accepted_draft_tokens", "accepted_draft_tokens", "drafted tokens kept in an output (with "
             "draft_tokens_total: the acceptance rate)"),
        ):
            yield counter(name, attr, doc)
        yield gauge("prompt_cache_bytes", "prompt_cache_bytes", "bytes of KV the prompt cache holds")
        yield gauge("prompt_cache_entries", "prompt_cache_entries", "entries the prompt cache holds")
        # MLX's memory is the process's: the freshest reading (one engine's, or of several models)
        read = [s for _, s in sources if s is not None]
        mem = max(read, key=lambda s: s.memory_read_at) if read else None
        yield GaugeMetricFamily(PREFIX + "mlx_active_memory_bytes", "MLX memory in use (read every few "
                                "dozen steps)", value=num(mem, "active_memory_bytes"))
        yield GaugeMetricFamily(PREFIX + "mlx_peak_memory_bytes", "MLX peak memory",
                                value=max((num(s, "peak_memory_bytes") for s in read), default=0.0))
        yield GaugeMetricFamily(PREFIX + "mlx_cache_memory_bytes", "freed MLX buffers kept for reuse",
                                value=num(mem, "cache_memory_bytes"))
        if pool is not None:
            yield from _model_families(pool)
        group = engine.group if engine is not None else None
        if group is not None:  # rank 0 of a distributed group (docs/distributed.md)
            snap = group.snapshot()
            size = GaugeMetricFamily(PREFIX + "group_size", "ranks of the distributed group, by backend and "
                                     "mode", labels=["backend", "mode"])
            size.add_metric([snap["backend"], snap["mode"]], float(snap["size"]))
            yield size
            ranks = GaugeMetricFamily(PREFIX + "group_rank_state", "1 for each rank's state", labels=["rank", "state"])
            for r in snap["ranks"]:
                ranks.add_metric([str(r["rank"]), r["state"]], 1.0)
            yield ranks
            yield GaugeMetricFamily(PREFIX + "group_seconds_since_contact", "seconds since the last collective "
                                    "with the followers completed", value=snap["seconds_since_contact"])
            yield CounterMetricFamily(PREFIX + "group_messages", "command messages rank 0 sent its followers "
                                      "(one per step, heartbeats while idle)", value=float(group.messages))


def _model_families(pool: Any) -> Iterator[Metric]:
    """With `--models`: each model's state, loads and requests, and its engine's figures while it
    is loaded (an engine's counters start again at 0 when its model loads again)."""
    states = GaugeMetricFamily(PREFIX + "model_state", "1 for each model's state (unloaded, loading, "
                               "loaded, unloading)", labels=["model", "state"])
    loads = CounterMetricFamily(PREFIX + "model_loads", "times each model was loaded", labels=["model"])
    in_flight = GaugeMetricFamily(PREFIX + "model_requests_in_flight", "each model's requests in flight",
                                  labels=["model"])
    figures = {attr: CounterMetricFamily(PREFIX + "model_" + attr, doc + " (while loaded)", labels=["model"])
               for attr, doc in (("requests_finished", "requests each model's engine ended"),
                                 ("prompt_tokens", "prompt tokens each model prefilled"),
                                 ("generated_tokens", "tokens each model generated"),
                                 ("prompt_cache_hit_tokens", "prompt tokens each model's prompt cache served"))}
    cache = GaugeMetricFamily(PREFIX + "model_prompt_cache_bytes", "bytes of KV each model's prompt cache "
                              "holds", labels=["model"])
    for st in pool.status():
        states.add_metric([st.name, st.state], 1.0)
        loads.add_metric([st.name], float(st.loads))
        in_flight.add_metric([st.name], float(st.in_flight))
        engine = pool.engine(st.name)
        stats = engine.statistics() if engine is not None else None
        for attr, family in figures.items():
            family.add_metric([st.name], float(getattr(stats, attr)) if stats is not None else 0.0)
        cache.add_metric([st.name], float(stats.prompt_cache_bytes) if stats is not None else 0.0)
    yield from (states, loads, in_flight, *figures.values(), cache)
