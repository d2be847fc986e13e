"""Numbers from the environment (NANOEULER_TIMEOUT, RANK, NANOEULER_FETCH_RETRIES, ...), read one way: unset or
empty means the default, and a bad value is a one-line UserError naming the variable.

    env_int("NANOEULER_STEP_TIMEOUT", 1800, minimum=1)
    env_int("RANK", env=variables)                  # no default: unset is an error
    env_float("NANOEULER_FETCH_BACKOFF", 2.0, minimum=0.0)
"""
import math
import os

from nanoeuler.errors import UserError


def env_int(name, default=None, minimum=0, env=None):
    """The integer in variable `name` of `env` (os.environ by default), at least `minimum`; without a default
    the variable must be set."""
    return _number(name, default, minimum, int, "an integer", env)


def env_float(name, default=None, minimum=0.0, env=None):
    """The finite number in variable `name` of `env` (os.environ by default), at least `minimum`."""
    return _number(name, default, minimum, float, "a number", env)


def _number(name, default, minimum, kind, what, env):
    text = (os.environ if env is None else env).get(name)
    if text is None or not text.strip():
        if default is None:
            raise UserError(f"{name} is not set")
        return default
    try:
        value = kind(text)
    except ValueError:
        raise UserError(f"{name}={text!r} is not {what}") from None
    if not math.isfinite(value):
        raise UserError(f"{name}={text!r} is not {what}")
    if value < minimum:
        raise UserError(f"{name}={text.strip()} must be at least {minimum}")
    return value
