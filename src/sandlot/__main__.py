"""``python -m sandlot``: the ``sandlot`` command, for when its script is not on PATH."""

from sandlot.cli import app

app(prog_name="sandlot")
