"""Outputs: Prometheus exposition over HTTP (and, later, the textfile and ledger writers)."""
