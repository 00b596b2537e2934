"""Idle and underuse detection: the rule engine and its thresholds."""
