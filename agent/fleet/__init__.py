"""The fleet: cost and usage of every node, read from the Prometheus-compatible store the nodes'
agents are scraped into (report.py), exactly (source.py, counters.py), over its query API
(promapi.py, the one module that speaks HTTP)."""

from __future__ import annotations

DEFAULT_TIMEOUT_S = 120.0  # a query's time limit, on the store and in the client
DEFAULT_NODE_LABEL = "instance"  # the shipped scrape configs set it to the node's name
