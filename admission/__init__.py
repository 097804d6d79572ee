"""Admission control: deadlines and tiers, predictions, the EDF gate, tenant limits (see policy.py)."""
