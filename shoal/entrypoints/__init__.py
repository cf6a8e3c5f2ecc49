"""Entry points: the `shoal` command line and the OpenAI-compatible server."""
