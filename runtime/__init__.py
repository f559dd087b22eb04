"""phasesplit runtime: model, engine, KV transfer, worker and router servers, CLI."""
