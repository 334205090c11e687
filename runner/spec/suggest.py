"""Did-you-mean suggestions, matched and worded the same everywhere: ``(did you mean "x"?)``.

Used for unknown spec keys and choices, unknown model, dataset and factory names, and the keys
given to ``--allow-spec-change``. Names and values are quoted as TOML strings (``"mode"``);
dotted keys are written bare (``optim.lr``), as in ``FILE:LINE: dotted.key:`` prefixes.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping, Sequence

from runner.spec.wording import join_or, show

CUTOFF = 0.6  # difflib.get_close_matches' default similarity bound


def close_matches(word: str, choices: Iterable[str] | Mapping[str, str], n: int = 1) -> list[str]:
    """Return up to ``n`` choices close to ``word``, ignoring case; an exact match ignoring case comes alone.

    Args:
        word: What the user wrote.
        choices: The valid names; or a mapping from the text to match against to the name to
            suggest (e.g. ``{"resnet18": "torchvision.resnet18"}`` to match bare builder names).
        n: Most suggestions returned.

    Returns:
        The suggested names, closest first (``difflib.get_close_matches`` with cutoff 0.6).
    """
    table = dict(choices) if isinstance(choices, Mapping) else {c: c for c in choices}
    lowered: dict[str, str] = {}
    for match_text, name in table.items():
        lowered.setdefault(match_text.lower(), name)
    word = word.lower()
    if word in lowered:
        return [lowered[word]]
    return [lowered[c] for c in difflib.get_close_matches(word, list(lowered), n=n, cutoff=CUTOFF)]


def suggest(candidates: Sequence[str], render: Callable[[str], str] = show) -> str:
    """Return ``did you mean "a" or "b"?`` for ``candidates`` (empty text when there are none).

    Args:
        candidates: Names to offer, best first.
        render: How each is written: :func:`~runner.spec.wording.show` (quoted, the default) for
            names and values, ``str`` for dotted keys.
    """
    return f"did you mean {join_or([render(c) for c in candidates])}?" if candidates else ""


def did_you_mean(
    word: object,
    choices: Iterable[str] | Mapping[str, str],
    n: int = 1,
    render: Callable[[str], str] = show,
) -> str:
    """Return ``did you mean "x"?`` for the choices closest to ``word``, or empty text.

    Put it in a message with :func:`~runner.spec.wording.with_hint`: ``unknown key "mdoe"
    (did you mean "mode"?)``.

    Args:
        word: What the user wrote (non-strings are compared as ``str(word)``).
        choices: Valid names, or a mapping as in :func:`close_matches`.
        n: Most suggestions.
        render: How each suggestion is written (see :func:`suggest`).
    """
    return suggest(close_matches(str(word), choices, n), render)
