"""`phasesplit bench`: a serving benchmark for any OpenAI-compatible endpoint.

workload (what to send), load (when to send it), client (how, over HTTP streaming),
metrics (pure statistics), report (table, JSON, plots), cli (the subcommand).
"""
