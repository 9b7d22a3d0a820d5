"""What a run is given and what it implies: the settings (:mod:`~lmppo.inputs.config`, their reference page
:mod:`~lmppo.inputs.config_reference`), every decision they imply made once (:mod:`~lmppo.inputs.resolve`:
the ``RunSpec``), and the prompts and demonstrations (:mod:`~lmppo.inputs.data`). Nothing here loads a model,
and the settings import no torch, so help and config errors are fast.

May import: the basics and :mod:`lmppo.math`."""
