"""``python -m lmppo`` is the ``lmppo`` command."""

from lmppo.cli import main

main()
