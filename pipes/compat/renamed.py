"""Keyword arguments renamed so that one concept has one word across the package (issue #26):
the old keyword still works, with a ``DeprecationWarning`` naming the new one.

>>> import warnings
>>> @renamed_keywords(on_overlong="overlong")
... def plan(lengths, *, overlong="raise"):
...     return overlong
>>> with warnings.catch_warnings(record=True) as seen:
...     warnings.simplefilter("always")
...     plan([1], on_overlong="drop"), str(seen[0].message)
('drop', 'plan(on_overlong=...) is deprecated: use overlong=...')
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["renamed_keywords"]

F = TypeVar("F", bound=Callable[..., Any])


def renamed_keywords(**old_to_new: str) -> Callable[[F], F]:
    """Accept each old keyword of the decorated function as its new one (warned); both at once
    is a ``TypeError``."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            for old, new in old_to_new.items():
                if old not in kwargs:
                    continue
                if new in kwargs:
                    raise TypeError(f"{fn.__name__}() got both {old}= and {new}= (the same option)")
                warnings.warn(
                    f"{fn.__name__}({old}=...) is deprecated: use {new}=...",
                    DeprecationWarning,
                    stacklevel=2,
                )
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return inner  # type: ignore[return-value]

    return wrap
