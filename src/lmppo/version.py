"""lmppo's version, in a module of its own: the package re-exports it, and a module that records or prints
it (a checkpoint's manifest, ``lmppo --version``) imports it from here, never the top package (whose
``lmppo.train`` reaches back into them)."""

__version__ = "0.1.0"
