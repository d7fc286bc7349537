"""The search space: Hydra's sweep syntax over any config key, as Optuna distributions.

`hydra.sweeper.params` (and sweeps on the command line) use the syntax of Hydra's `-m`:
`interval(0.01, 1.0)` a float, `tag(log, interval(1e-4, 1e-1))` on a log scale, `int(interval(8, 64))` an integer,
`range(0, 4)` the integers 0..3, `choice(32, 64, 128)` or `32,64,128` one of those values. A plain value is the same
in every trial.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, QuotedString, RangeSweep
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution

from scaleup.config.plain import flatten
from scaleup.errors import UserError


@dataclass(frozen=True)
class SearchSpace:
    """The distributions a trial draws from (by config key) and the overrides every trial shares."""

    distributions: dict[str, BaseDistribution]
    fixed: list[str]

    def overrides(self, params: dict[str, Any]) -> list[str]:
        """A trial's command line: the shared overrides, then its drawn values."""
        return [*self.fixed, *as_overrides(params)]

    def corners(self) -> list[dict[str, Any]]:
        """Values that span the space: every key at its low end, every key at its high end, and each choice. A key
        that does not exist or a value of the wrong type shows in one of them."""
        low = {key: bounds(dist)[0] for key, dist in self.distributions.items()}
        high = {key: bounds(dist)[-1] for key, dist in self.distributions.items()}
        each = [{**low, key: value} for key, dist in self.distributions.items() for value in bounds(dist)[1:-1]]
        return [low, high, *each]


def parse_space(params: dict[str, str], arguments: list[str]) -> SearchSpace:
    """The space of `hydra.sweeper.params` and the command line's overrides: a sweep there joins the space (or
    replaces a key's range), a plain value there takes its key out of the space."""
    lines = [f"{key}={value}" for key, value in flatten(params).items()] + list(arguments)
    distributions: dict[str, BaseDistribution] = {}
    fixed = []
    for override in (parsed(line) for line in lines):
        if override.is_sweep_override():
            distributions[override.get_key_element()] = distribution(override)
        else:
            distributions.pop(override.get_key_element(), None)
            fixed.append(override.input_line)
    if not distributions:
        raise UserError(
            "search space: nothing to search; set hydra.sweeper.params, e.g. "
            "model.optimizer.lr: tag(log, interval(0.01, 1.0))"
        )
    return SearchSpace(distributions, fixed)


def parsed(line: str) -> Override:
    try:
        return OverridesParser.create().parse_override(line)
    except Exception as err:  # Hydra's grammar error: where in the line it stopped
        raise UserError(f"search space: {line}: {str(err).splitlines()[0]}") from None


def distribution(override: Override) -> BaseDistribution:
    """The Optuna distribution of one sweep override."""
    value, where = override.value(), override.input_line
    if isinstance(value, RangeSweep) and all(isinstance(v, int) for v in (value.start, value.stop, value.step)):
        return IntDistribution(value.start, value.stop - 1, step=value.step)
    if isinstance(value, (ChoiceSweep, RangeSweep)):
        choices = [v.text if isinstance(v, QuotedString) else v for v in override.sweep_iterator()]
        if not all(v is None or isinstance(v, (bool, int, float, str)) for v in choices):
            raise UserError(f"search space: {where}: a choice is a number, a string, true, false or null")
        return CategoricalDistribution(choices)
    if isinstance(value, IntervalSweep):
        log = "log" in value.tags
        if value.start >= value.end:
            raise UserError(f"search space: {where}: the interval's low end must be below its high end")
        if log and value.start <= 0:
            raise UserError(f"search space: {where}: a log scale needs a low end above 0")
        kind = IntDistribution if isinstance(value.start, int) and isinstance(value.end, int) else FloatDistribution
        return kind(value.start, value.end, log=log)
    raise UserError(f"search space: {where}: use interval(), range() or choice()")


def bounds(dist: BaseDistribution) -> list[Any]:
    """A distribution's low and high ends, or its choices."""
    if isinstance(dist, CategoricalDistribution):
        return list(dist.choices)
    return [dist.low, dist.high]


def as_overrides(params: dict[str, Any]) -> list[str]:
    """`key=value` for each drawn value, as Hydra reads it back."""
    return [f"{key}={override_value(value)}" for key, value in params.items()]


def override_value(value: Any) -> str:
    """`value` as the right-hand side of an override that Hydra reads back as the same value."""
    plain = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    if isinstance(value, float):
        plain = repr(value)
    parsed = OverridesParser.create().parse_override(f"key={plain}").value()
    return plain if type(parsed) is type(value) and parsed == value else repr(value)  # a string like "1": quoted
