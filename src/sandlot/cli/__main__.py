"""``python -m sandlot.cli``: how the tests and benchmarks start the command."""

from sandlot.cli import app

app()
