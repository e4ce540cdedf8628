"""Environment variable references in config strings: ``${NAME}`` and ``${NAME:-default}``.

``${NAME}`` is replaced by the variable's value and is an error when the
variable is unset; ``${NAME:-default}`` uses ``default`` when the variable is
unset or empty (the default is literal text: no nesting). ``$${`` writes a
literal ``${``; any other ``$`` is kept as written.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_REFERENCE = re.compile(r"\$\$\{|\$\{([^}]*)\}|\$\{")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class InterpolationError(ValueError):
    """A reference names an unset variable or is malformed."""


def interpolate(text: str, env: Mapping[str, str]) -> tuple[str, bool]:
    """``text`` with every reference replaced, and whether any variable was referenced."""
    if "${" not in text:
        return text, False
    referenced = False

    def replace(match: re.Match[str]) -> str:
        nonlocal referenced
        token = match.group(0)
        if token == "$${":
            return "${"
        if token == "${":
            raise InterpolationError("unterminated '${' (write '$${' for a literal '${')")
        name, has_default, default = match.group(1).partition(":-")
        if not _NAME.fullmatch(name):
            raise InterpolationError(
                f"bad environment reference '${{{match.group(1)}}}': write ${{NAME}} or ${{NAME:-default}}"
            )
        referenced = True
        value = env.get(name)
        if has_default and not value:
            return default
        if value is None:
            raise InterpolationError(
                f"environment variable {name} is not set (write ${{{name}:-default}} to give a default)"
            )
        return value

    return _REFERENCE.sub(replace, text), referenced
