"""Errors of the namespace that are also the type TransformerLens raises for the same bad input.

TransformerLens checks input with `assert`, so code written for it catches `AssertionError`; lenskit raises
`ValueError` / `KeyError` with a one-line message. Where the namespace refuses what TransformerLens asserts, it
raises a class that is both (`ValueAssertionError` is a `ValueError` and an `AssertionError`), with lenskit's
message, so `except ValueError` and `pytest.raises(AssertionError)` both hold.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class ValueAssertionError(ValueError, AssertionError):
    """lenskit's ValueError where TransformerLens asserts."""


class KeyAssertionError(KeyError, AssertionError):
    """lenskit's KeyError (an unknown or switched-off hook name) where TransformerLens asserts."""


def asserting(error: BaseException) -> BaseException:
    """`error` as its dual type (same message, same cause); other errors unchanged."""
    for base, dual in ((KeyError, KeyAssertionError), (ValueError, ValueAssertionError)):
        if isinstance(error, base) and not isinstance(error, AssertionError):
            twin = dual(*error.args)
            twin.__cause__, twin.__traceback__ = error.__cause__, error.__traceback__
            return twin
    return error


def asserts(fn: F) -> F:
    """`fn` raising the dual type where it raises ValueError or KeyError (where TransformerLens asserts)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (ValueError, KeyError) as error:
            raise asserting(error) from error.__cause__

    return wrapper  # type: ignore[return-value]
