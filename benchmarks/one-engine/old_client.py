"""`python benchmarks/one-engine/old_client.py bench ... serve --clients 4,8 ...`: the `quantkit` command line with the
bench's load as it was before one client served a run: a new httpx client per request (each builds an SSL
context on its client's thread while the request is timed). The A/B of reports/one-engine/bench-client.md.
"""

import sys

import httpx

from quantkit.bench import serve_agents, serve_slots
from quantkit.cli import main

# what `httpx.stream(...)` made for every request
serve_slots.http = serve_agents.http = lambda: httpx.Client(timeout=900)
sys.argv = ["quantkit", *sys.argv[1:]]
main()
