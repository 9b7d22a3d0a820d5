"""What a user calls: the ``lmppo`` command (:mod:`~lmppo.interface.cli`, a thin layer), the Python API
(:mod:`~lmppo.interface.api`, ``lmppo.train``), ``lmppo init``'s starter config
(:mod:`~lmppo.interface.starter`) and the quickstart (:mod:`~lmppo.interface.quickstart`).

May import: anything in lmppo."""
