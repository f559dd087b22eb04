"""Where the planner's numbers come from: the pods' /metrics pages, or a Prometheus server.

Both sources produce the same MetricsSnapshot; the aggregation from raw samples is pure
(aggregate.py, histogram.py) and the I/O is kept to scrape.py and prometheus.py.
"""
