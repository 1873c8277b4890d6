"""`Registry`: add, look up, override, remove, and option filtering."""

from __future__ import annotations

import pytest

from hybridflow.algorithms import Registry


def test_register_lookup_override_unregister():
    reg = Registry("widget", n_args=1)

    @reg.register("double")
    def double(x, scale: float = 1.0):
        return 2 * x * scale

    assert reg.get_fn("double") is double and list(reg) == ["double"] and len(reg) == 1
    assert reg.call("double", (3,), {"scale": 2.0}) == 12.0
    with pytest.raises(ValueError, match="already registered"):
        reg.register("double")(lambda x: x)
    reg.register("double", override=True)(lambda x: -x)
    assert reg.call("double", (3,), {}) == -3
    reg.unregister("double")
    with pytest.raises(ValueError, match="unknown widget 'double'"):
        reg.get_fn("double")
    with pytest.raises(ValueError, match="non-empty string"):
        reg.register("")


def test_call_filters_options_per_entry_and_rejects_typos():
    reg = Registry("widget", n_args=1)
    reg.register("a")(lambda x, alpha=1: ("a", alpha))
    reg.register("b")(lambda x, beta=1: ("b", beta))
    assert reg.call("a", (0,), {"alpha": 5, "beta": 7}) == ("a", 5)
    assert reg.call("b", (0,), {"alpha": 5, "beta": 7}) == ("b", 7)
    with pytest.raises(TypeError, match="Did you mean 'alpha'"):
        reg.call("a", (0,), {"alpah": 5})
    # the data argument is not an option
    with pytest.raises(TypeError, match="unknown widget option 'x'"):
        reg.call("a", (0,), {"x": 1})
