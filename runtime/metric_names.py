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
LOCAL_PREFILL = PREFIX + "local_prefill_total"  # every prompt a decode worker prefilled itself
# A decode worker's placement decisions, extra labels where (local|remote) and reason
# (runtime/disagg/placement.py REASONS); exported by decode workers only, so not in COUNTERS.
PREFILL_PLACEMENT = PREFIX + "prefill_placement_total"
KV_TRANSFER_FAILURES = PREFIX + "kv_transfer_failures_total"  # failed remote prefill attempts
SUCCESS = PREFIX + "request_success_total"  # extra label: finished_reason

# Gauges (read from live state at scrape time).
RUNNING = PREFIX + "num_requests_running"
WAITING = PREFIX + "num_requests_waiting"
KV_USAGE = PREFIX + "kv_cache_usage_perc"
PREFILL_QUEUE_TOKENS = PREFIX + "prefill_queue_tokens"

# The router's held queue (requests that found no worker of a phase they need: a phase at zero,
# or none ready yet) and its lending. Only the router exports these (phase="router"); the
# operator's planner reads the held count as demand that wakes phases scaled to zero.
HELD = PREFIX + "num_requests_held"  # gauge
HELD_WAIT = PREFIX + "request_held_seconds"  # histogram: how long each held request waited
# Requests the router sent whole to an idle prefill worker (--lend-idle-prefill, routing.lend_prefill)
LENT_REQUESTS = PREFIX + "lent_requests_total"
ROUTER_GAUGES = (HELD,)
ROUTER_HISTOGRAMS = (HELD_WAIT,)
ROUTER_COUNTERS = (LENT_REQUESTS,)

HISTOGRAMS = (TTFT, ITL, E2E, QUEUE_TIME, KV_TRANSFER)
COUNTERS = (PROMPT_TOKENS, GENERATION_TOKENS, PREFIX_QUERIES, PREFIX_HITS, PREEMPTIONS, KV_BYTES,
            LOCAL_PREFILL, KV_TRANSFER_FAILURES, SUCCESS)
GAUGES = (RUNNING, WAITING, KV_USAGE, PREFILL_QUEUE_TOKENS)
ALL = HISTOGRAMS + COUNTERS + GAUGES

# The operator's own metrics (phasesplit.operator.telemetry), labelled namespace, inferenceservice
# and (but the reconcile ones) model.
OPERATOR_PREFIX = PREFIX + "operator_"
OPERATOR_RECONCILES = OPERATOR_PREFIX + "reconcile_total"
OPERATOR_RECONCILE_ERRORS = OPERATOR_PREFIX + "reconcile_errors_total"
OPERATOR_RECONCILE_SECONDS = OPERATOR_PREFIX + "reconcile_duration_seconds"
OPERATOR_PLANNER_DECISIONS = OPERATOR_PREFIX + "planner_decisions_total"
OPERATOR_PLANNER_DESIRED = OPERATOR_PREFIX + "planner_desired_replicas"
OPERATOR_PLANNER_PREDICTED = OPERATOR_PREFIX + "planner_predicted_seconds"
OPERATOR_PLANNER_OBSERVED = OPERATOR_PREFIX + "planner_observed_seconds"
OPERATOR_PLANNER_STALE = OPERATOR_PREFIX + "planner_metrics_stale"
OPERATOR_MAX_REPLICAS = OPERATOR_PREFIX + "max_replicas"
OPERATOR_SLO_TARGET = OPERATOR_PREFIX + "slo_target_seconds"
OPERATOR_SLO_ERROR_BUDGET = OPERATOR_PREFIX + "slo_error_budget"
OPERATOR_SLO_BUCKET = OPERATOR_PREFIX + "slo_bucket_info"
OPERATOR_DEPLOYMENT_INFO = OPERATOR_PREFIX + "deployment_info"

# Histogram bucket bounds (the `le` labels): part of the contract too, since the operator names the
# bucket an SLO target falls in for the alert rules (phasesplit.operator.telemetry).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
HELD_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0)
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
