"""``python -m lmppo`` is the ``lmppo`` command."""

from lmppo.interface.cli import main

main()
