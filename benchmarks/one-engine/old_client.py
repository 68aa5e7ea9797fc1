"""`python benchmarks/one-engine/old_client.py bench ... serve --clients 4,8 ...`: the `quantkit` command line with the
bench's load as it was before one client served a run: a new httpx client per request (each builds an SSL
context on its client's thread while the request is timed). The A/B of reports/one-engine/bench-client.md.
"""

import sys

import httpx

from quantkit.bench import serve_slots
from quantkit.cli import main

serve_slots.http = lambda: httpx.Client(timeout=900)  # what `httpx.stream(...)` made for every request
sys.argv = ["quantkit", *sys.argv[1:]]
main()
