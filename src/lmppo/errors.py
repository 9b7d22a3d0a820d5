"""The one exception type for user mistakes (bad config, bad data, missing files).

The CLI prints an ``LmppoError`` as a short paragraph without a traceback; anything else is a bug
and keeps its traceback. Messages name the thing that is wrong and say how to fix it.
"""


class LmppoError(Exception):
    """A user-facing error: the message says what is wrong and what to do about it."""
