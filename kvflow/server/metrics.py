"""Prometheus metrics with vLLM's names, so vLLM's Grafana dashboards work unchanged.

One CollectorRegistry per app. `PrometheusStatLogger.record` is called by AsyncLLM from the
engine thread once per iteration (prometheus_client metrics are thread-safe). What is measured:

- gauges from the scheduler after every iteration: vllm:num_requests_running,
  vllm:num_requests_waiting, vllm:kv_cache_usage_perc (fraction of KV blocks held by requests,
  0..1 like vLLM);
- counters (exposed with the `_total` suffix, as vLLM's): vllm:num_preemptions,
  vllm:prefix_cache_queries / vllm:prefix_cache_hits (tokens), vllm:prompt_tokens (counted when
  a request is first scheduled), vllm:generation_tokens (every sampled token, including those of
  requests aborted later), vllm:request_success{finished_reason} with "stop", "length",
  "abort" (a client disconnect or an explicit abort) and "error" (a request the engine failed
  alone);
- histograms from AsyncLLM's timestamps (see kvflow/engine/async_llm.py): TTFT (arrival ->
  the step that produced the first token returns), inter-token latency (per step that produced
  tokens for a request, the time since its previous such step), e2e latency, queue time
  (arrival -> start of the first step that scheduled it), prefill/decode/inference time, time per
  output token, prompt and generation lengths. Aborted requests are left out of the latency
  histograms, as in vLLM. With n > 1 each child counts as a request there (as in vLLM), and
  vllm:request_params_n / vllm:request_max_num_generation_tokens count the parent once;
- with speculative decoding: vllm:spec_decode_num_drafts, vllm:spec_decode_num_draft_tokens,
  vllm:spec_decode_num_accepted_tokens and vllm:spec_decode_num_accepted_tokens_per_pos{position}.
"""
from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvflow.core.outputs import SpecDecodingStats
from kvflow.engine.async_llm import IterationStats

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000]
FINISH_REASONS = ("stop", "length", "abort", "error")

# No `*_created` series next to every counter and histogram (vLLM turns them off too).
prometheus_client.disable_created_metrics()
_NO_SPEC = SpecDecodingStats()


class PrometheusStatLogger:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        L = ["model_name"]

        def gauge(name, doc):
            return Gauge(name, doc, L, registry=r, multiprocess_mode="mostrecent").labels(
                model_name)

        def counter(name, doc):
            return Counter(name, doc, L, registry=r).labels(model_name)

        def hist(name, doc, buckets):
            return Histogram(name, doc, L, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc",
                              "KV-cache usage: fraction of blocks held by requests (0..1).")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative preemptions.")
        self.pc_queries = counter("vllm:prefix_cache_queries",
                                  "Prefix-cache queries, in tokens.")
        self.pc_hits = counter("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        success = Counter("vllm:request_success", "Finished requests by finish reason.",
                          L + ["finished_reason"], registry=r)
        self.success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Inter-token latency.", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                        LATENCY_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds",
                          "Time from arrival to first scheduling.", LATENCY_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds",
                            "First scheduling to first token.", LATENCY_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds", "First token to last token.",
                           LATENCY_BUCKETS)
        self.inference = hist("vllm:request_inference_time_seconds",
                              "First scheduling to last token.", LATENCY_BUCKETS)
        self.tpot = hist("vllm:request_time_per_output_token_seconds",
                         "Per request: decode time / (output tokens - 1).", ITL_BUCKETS)
        self.req_prompt = hist("vllm:request_prompt_tokens", "Prompt length per request.",
                               TOKEN_BUCKETS)
        self.req_gen = hist("vllm:request_generation_tokens", "Output length per request.",
                            TOKEN_BUCKETS)
        self.params_n = hist("vllm:request_params_n", "The n of finished requests.",
                             [1, 2, 5, 10, 20])
        self.max_gen = hist("vllm:request_max_num_generation_tokens",
                            "Longest output of each finished request's n.", TOKEN_BUCKETS)
        self._last = (0,) * 6       # cumulative scheduler counters seen so far
        self.spec_drafts = counter("vllm:spec_decode_num_drafts",
                                   "Requests verified with draft tokens, counted per step.")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens",
                                         "Draft tokens verified.")
        self.spec_accepted = counter("vllm:spec_decode_num_accepted_tokens",
                                     "Draft tokens accepted.")
        self._spec_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by position in the draft.",
                                     L + ["position"], registry=r)
        self._per_pos_last: list[int] = []
        self._counters = (self.preemptions, self.pc_queries, self.pc_hits, self.spec_drafts,
                          self.spec_draft_tokens, self.spec_accepted)

    def _record_per_pos(self, per_pos: list[int]) -> None:
        """Like the counters in record(): cumulative values in, increments out."""
        old = self._per_pos_last + [0] * (len(per_pos) - len(self._per_pos_last))
        for i, (new, seen) in enumerate(zip(per_pos, old)):
            if new > seen:
                self._spec_per_pos.labels(self.model_name, str(i)).inc(new - seen)
        self._per_pos_last = [max(a, b) for a, b in zip(per_pos, old)]

    def record(self, s: IterationStats) -> None:
        ss = s.scheduler_stats
        self.running.set(ss.num_running_reqs)
        self.waiting.set(ss.num_waiting_reqs)
        self.kv_usage.set(ss.kv_cache_usage)
        sd = ss.spec_decoding or _NO_SPEC
        cur = (ss.num_preemptions, ss.prefix_cache_queries, ss.prefix_cache_hits,
               sd.num_drafts, sd.num_draft_tokens, sd.num_accepted_tokens)
        for c, new, old in zip(self._counters, cur, self._last):
            if new > old:
                c.inc(new - old)
        self._last = tuple(max(a, b) for a, b in zip(cur, self._last))
        if sd.num_accepted_tokens_per_pos:
            self._record_per_pos(sd.num_accepted_tokens_per_pos)
        if s.num_prompt_tokens:
            self.prompt_tokens.inc(s.num_prompt_tokens)
        if s.num_generation_tokens:
            self.generation_tokens.inc(s.num_generation_tokens)
        for t in s.time_to_first_tokens:
            self.ttft.observe(t)
        for t in s.inter_token_latencies:
            self.itl.observe(t)
        for n, m in zip(s.n_params, s.max_num_generation_tokens):
            self.params_n.observe(n)
            self.max_gen.observe(m)
        for f in s.finished_requests:
            self.success[f.finish_reason if f.finish_reason in self.success else "stop"].inc()
            if f.finish_reason == "abort":
                continue
            self.e2e.observe(f.e2e_latency)
            self.req_prompt.observe(f.num_prompt_tokens)
            self.req_gen.observe(f.num_generation_tokens)
            if f.queue_time is not None:
                self.queue.observe(f.queue_time)
                self.inference.observe(f.e2e_latency - f.queue_time)
            if f.prefill_time is not None:
                self.prefill.observe(f.prefill_time)
            if f.decode_time is not None:
                self.decode.observe(f.decode_time)
                if f.num_generation_tokens > 1:
                    self.tpot.observe(f.decode_time / (f.num_generation_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
