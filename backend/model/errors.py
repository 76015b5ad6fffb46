"""Errors raised while locating, converting or loading model files."""


class ModelLoadError(Exception):
    """A model file is missing, corrupt or unsupported.

    The message always names the offending file (or package) and the problem, so it
    can be shown to an operator as-is.
    """
