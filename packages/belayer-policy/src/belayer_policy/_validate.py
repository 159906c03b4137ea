"""Argument checks shared by the estimators, the policy and the simulator.

Each check raises :class:`PolicyArgumentError` (a ``ValueError``) whose message names the argument,
so a bad configuration fails where it is made and says what to change.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

from belayer_policy._errors import PolicyArgumentError

__all__ = [
    "non_negative",
    "positive",
    "positive_int",
    "probability",
    "renamed_keywords",
    "require_non_negative",
    "require_positive",
    "require_probability",
    "unit_fraction",
]


def _require_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PolicyArgumentError(f"{name} must be a number, got {value!r}")
    number = float(value)
    if math.isnan(number):
        raise PolicyArgumentError(f"{name} must be a number, got NaN")
    return number


def require_non_negative(name: str, value: object, *, allow_inf: bool = False) -> float:
    """Return ``value`` as a float or raise if it is negative, NaN or (unless allowed) infinite."""
    if type(value) is float and 0.0 <= value < math.inf:  # the common case, checked in one step
        return value
    number = _require_number(name, value)
    if number < 0 or (math.isinf(number) and not allow_inf):
        raise PolicyArgumentError(f"{name} must be a finite number >= 0, got {value!r}")
    return number


def require_positive(name: str, value: object) -> float:
    """Return ``value`` as a float or raise unless it is finite and > 0."""
    number = _require_number(name, value)
    if not 0 < number < math.inf:
        raise PolicyArgumentError(f"{name} must be a finite number > 0, got {value!r}")
    return number


def require_probability(name: str, value: object) -> float:
    """Return ``value`` as a float or raise unless it lies in [0, 1]."""
    number = _require_number(name, value)
    if not 0.0 <= number <= 1.0:
        raise PolicyArgumentError(f"{name} must be a probability in [0, 1], got {value!r}")
    return number


def renamed_keywords(where: str, given: Mapping[str, float], renames: Mapping[str, str]) -> dict[str, float]:
    """Map keywords renamed in 0.2 (``cooldown_seconds`` -> ``cooldown_s``) to their new names.

    Each old keyword warns with a ``DeprecationWarning``; an unknown one raises ``TypeError`` like
    any unexpected keyword argument.
    """
    result = {}
    for old, value in given.items():
        new = renames.get(old)
        if new is None:
            raise TypeError(f"{where}() got an unexpected keyword argument {old!r}")
        warnings.warn(f"{where}: {old}= is deprecated, use {new}=", DeprecationWarning, stacklevel=3)
        result[new] = value
    return result


# attrs validators: same checks, named after the attribute.
def non_negative(_instance: object, attribute: Any, value: Any) -> None:
    """attrs validator: finite and >= 0."""
    require_non_negative(attribute.name, value)


def positive(_instance: object, attribute: Any, value: Any) -> None:
    """attrs validator: finite and > 0."""
    require_positive(attribute.name, value)


def probability(_instance: object, attribute: Any, value: Any) -> None:
    """attrs validator: in [0, 1]."""
    require_probability(attribute.name, value)


def positive_int(_instance: object, attribute: Any, value: Any) -> None:
    """attrs validator: an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PolicyArgumentError(f"{attribute.name} must be an integer >= 1, got {value!r}")


def unit_fraction(_instance: object, attribute: Any, value: Any) -> None:
    """attrs validator: in (0, 1]."""
    number = _require_number(attribute.name, value)
    if not 0.0 < number <= 1.0:
        raise PolicyArgumentError(f"{attribute.name} must be in (0, 1], got {value!r}")
