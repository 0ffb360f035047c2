"""Testing helpers: checks for users' own nodes (``assert_resumable``, ``assert_exactly_once``),
the generated demo corpus and the embedded tiny processors and models (docs/architecture.md).

``from neatpack.pipes.testing import assert_resumable`` keeps working: the checks live in
``resume.py`` and are re-exported here.
"""

from neatpack.pipes.testing.resume import assert_exactly_once, assert_resumable, same_item

__all__ = ["assert_exactly_once", "assert_resumable", "same_item"]
