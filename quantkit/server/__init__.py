"""`quantkit serve`: an OpenAI-compatible HTTP server on the quantized runtime (see app.py)."""
