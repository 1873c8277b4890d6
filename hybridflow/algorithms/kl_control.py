"""KL coefficient controllers for KL-in-reward: fixed, and adaptive (Ziegler et al. 2019, arXiv:1909.08593).

Both expose `.value` (the coefficient to use now), `.update(current_kl, n_steps)` (called once per
training step with the batch KL, e.g. `mean_kl(...)`, and the number of samples or steps it covers),
and `state_dict()` / `load_state_dict()` so a resumed run continues with the same coefficient.
"""

from __future__ import annotations

from typing import Any


class FixedKLController:
    """A constant coefficient; `update` does nothing."""

    def __init__(self, coef: float) -> None:
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient stays `coef`."""

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "fixed", "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller steering the observed KL towards `target`.

    update: e = clip(current_kl / target - 1, -0.2, 0.2); value *= 1 + e * n_steps / horizon.
    """

    def __init__(self, init_coef: float, target: float, horizon: float) -> None:
        if not target > 0:
            raise ValueError(f"adaptive KL controller: target must be > 0, got {target}")
        if not horizon > 0:
            raise ValueError(f"adaptive KL controller: horizon must be > 0, got {horizon}")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move `.value` up when the KL is above target and down when below (at most 20 % per horizon)."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "adaptive", "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = float(state["horizon"])


KL_CONTROLLERS = ("fixed", "adaptive")


def make_kl_controller(
    kind: str, coef: float, target: float | None = None, horizon: float | None = None
) -> FixedKLController | AdaptiveKLController:
    """`fixed` -> `FixedKLController(coef)`; `adaptive` -> `AdaptiveKLController(coef, target, horizon)`."""
    if kind == "fixed":
        return FixedKLController(coef)
    if kind == "adaptive":
        if target is None or horizon is None:
            raise ValueError(
                f"the adaptive KL controller needs target and horizon, got target={target}, horizon={horizon}"
            )
        return AdaptiveKLController(coef, target, horizon)
    raise ValueError(f"unknown KL controller {kind!r}; valid: {KL_CONTROLLERS}")
