"""The Prometheus metric names the runtime exports and the operator reads: one definition.

Torch-free and import-light: the operator (aggregate, Prometheus queries, the HPAs render
targets) imports it without the serving stack. Names follow vLLM's where one exists
(prefix phasesplit_, labels model and phase), so dashboards built for vLLM read them the same way.
"""

from __future__ import annotations

PREFIX = "phasesplit_"

# Histograms (seconds).
TTFT = PREFIX + "time_to_first_token_seconds"
ITL = PREFIX + "inter_token_latency_seconds"
E2E = PREFIX + "e2e_request_latency_seconds"
QUEUE_TIME = PREFIX + "request_queue_time_seconds"
KV_TRANSFER = PREFIX + "kv_transfer_seconds"

# Counters.
PROMPT_TOKENS = PREFIX + "prompt_tokens_total"
GENERATION_TOKENS = PREFIX + "generation_tokens_total"
PREFIX_QUERIES = PREFIX + "prefix_cache_queries_total"
PREFIX_HITS = PREFIX + "prefix_cache_hits_total"
PREEMPTIONS = PREFIX + "num_preemptions_total"
KV_BYTES = PREFIX + "kv_transfer_bytes_total"
LOCAL_PREFILL = PREFIX + "local_prefill_total"
SUCCESS = PREFIX + "request_success_total"  # extra label: finished_reason

# Gauges (read from live state at scrape time).
RUNNING = PREFIX + "num_requests_running"
WAITING = PREFIX + "num_requests_waiting"
KV_USAGE = PREFIX + "kv_cache_usage_perc"
PREFILL_QUEUE_TOKENS = PREFIX + "prefill_queue_tokens"

HISTOGRAMS = (TTFT, ITL, E2E, QUEUE_TIME, KV_TRANSFER)
COUNTERS = (PROMPT_TOKENS, GENERATION_TOKENS, PREFIX_QUERIES, PREFIX_HITS, PREEMPTIONS, KV_BYTES,
            LOCAL_PREFILL, SUCCESS)
GAUGES = (RUNNING, WAITING, KV_USAGE, PREFILL_QUEUE_TOKENS)
ALL = HISTOGRAMS + COUNTERS + GAUGES
