"""Trace-driven simulator of a phase-split deployment, for comparing autoscaling policies.

The planner under test is the operator's own (phasesplit.operator.planner), fed with
metrics computed from the simulated requests at simulated time.
"""
