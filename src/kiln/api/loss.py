"""The policy loss of an RL stage (`spec.stages[].rl.loss`): one variant per mode, told apart by
`mode`, each holding only the fields its mode reads. Torch-free, like the rest of the spec; the
trainer takes the model as it is (`TrainerConfig.loss`) and `src/kiln/services/trainer/loss.py`
computes it.

The CRD cannot express the union structurally: it shows one object with every variant's fields
and `mode` as an enum, and pydantic (`kiln validate`, the operator) refuses a field of the other
mode, naming it."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from kiln.api.base import Model

Aggregation = Literal["token-mean", "sequence-mean", "sequence-sum"]


class _LossBase(Model):
    aggregation: Aggregation = "token-mean"
    """`token-mean`: average over the batch's trained tokens; `sequence-mean`: average each
    trajectory over its tokens, then over trajectories; `sequence-sum` (Dr. GRPO): sum each
    trajectory's token losses and divide by trajectories x `rollout.sampling.maxTotalTokens`, a
    constant, so a long answer is not weighted down per token the way the means weigh it."""


class MaskedLoss(_LossBase):
    """Asynchronous agentic RL: the ratio is to the inference policy that generated each token,
    and tokens outside its window are dropped from the gradient (masked, not clipped); no
    separate IcePop, since that ratio already measures the distance to the inference engine."""

    mode: Literal["masked"] = "masked"
    """`masked` (the default when `mode` is left out)."""
    eps_low: float = Field(0.2, ge=0, lt=1)
    """Tokens with ratio below 1 - epsLow are masked out."""
    eps_high: float = Field(0.28, ge=0)
    """Tokens with ratio above 1 + epsHigh are masked out."""


class PPOLoss(_LossBase):
    """Reasoning RL: the ratio is to the trainer's weights at the start of the step, under PPO's
    clip, plus IcePop on the train/inference ratio as its own mask and weight. The two ratios
    differ only when a step takes several updates: give the stage `rl.minibatches` > 1."""

    mode: Literal["ppo"]
    """`ppo`."""
    eps_low: float = Field(0.2, ge=0, lt=1)
    """The clip's lower bound: 1 - epsLow."""
    eps_high: float = Field(0.28, ge=0)
    """The clip's upper bound: 1 + epsHigh."""
    dual_clip: float | None = Field(None, gt=1)
    """Bound the loss of negative-advantage tokens at dualClip * A (dual-clip PPO); null: no
    bound."""
    icepop_beta: float | None = Field(2.0, gt=1)
    """IcePop keeps a token only if pi_train_old / pi_infer is in [1/beta, beta] and weighs it
    by that ratio; null disables."""


class Correction(Model):
    """Rollout correction (`rl.correction`): importance weights of the trainer's policy at the
    start of the step to the inference policy that sampled the tokens, rho_t = pi_train_old /
    pi_infer, taken at one `level` and used in one `mode`. Applied on top of the loss mode's own
    masks (the double-sided window, PPO's clip, IcePop), to the policy term only.

    Levels: `token` (rho_t), `sequence` (the product of a trajectory's rho_t over its trained
    tokens), `geometric` (their geometric mean, a per-token average that does not grow with
    length). Modes: `truncate` weighs each token by min(w, upper) (truncated importance
    sampling, TIS: Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy
    RL training"; verl's `rollout_is`), `mask` drops the tokens (or whole trajectories) whose w
    is outside [lower, upper] and leaves the others' weight alone (rejection sampling; verl's
    `rollout_rs` at the same three levels). A dropped token gets exactly zero gradient."""

    level: Literal["token", "sequence", "geometric"]
    """`token`, `sequence` or `geometric` (see above)."""
    mode: Literal["truncate", "mask"]
    """`truncate` (TIS) or `mask` (rejection)."""
    upper: float = Field(2.0, gt=1)
    """truncate: the largest weight; mask: the largest w kept."""
    lower: float | None = Field(None, gt=0, lt=1)
    """mask: the smallest w kept (1/upper when left out); truncate: unused (must be unset)."""

    @model_validator(mode="after")
    def _bounds(self) -> "Correction":
        if self.mode == "truncate" and self.lower is not None:
            raise ValueError("rl.correction.lower applies to mode 'mask' only: truncate bounds "
                             "the weight from above (upper)")
        return self

    @property
    def low(self) -> float:
        return self.lower if self.lower is not None else 1.0 / self.upper


def correction_refusal(correction: "Correction | None", loss: "MaskedLoss | PPOLoss") -> str | None:
    """Why `correction` cannot go with `loss`, or None. Both refusals keep a token from being
    weighed twice by the same ratio."""
    if correction is None:
        return None
    if loss.mode == "masked" and (correction.mode == "truncate" or correction.level == "token"):
        return ("rl.correction: masked mode's ratio is already to the inference policy per token "
                "(weight and window), so only a sequence- or geometric-level mask adds to it; "
                f"got level {correction.level!r}, mode {correction.mode!r}")
    if loss.mode == "ppo" and correction.mode == "truncate" and loss.icepop_beta is not None:
        return ("rl.correction: mode 'truncate' weighs tokens by pi_train_old/pi_infer, which "
                "IcePop already does; set rl.loss.icepopBeta: null to use it, or use mode 'mask'")
    return None


LOSS_MODES: dict[str, type[_LossBase]] = {"masked": MaskedLoss, "ppo": PPOLoss}
"""Each mode's variant, for messages that say which mode a field belongs to."""


def _masked_by_default(value: Any) -> Any:
    # A manifest may leave `mode` out, as it could leave out the old `lossMode`: masked, the
    # default loss, is meant. The discriminator must be in the input, so it is put there.
    if isinstance(value, dict) and "mode" not in value:
        return {**value, "mode": "masked"}
    return value


Loss = Annotated[MaskedLoss | PPOLoss, Field(discriminator="mode"), BeforeValidator(_masked_by_default)]


def modes_with(alias: str) -> list[str]:
    """The loss modes whose variant has a field written `alias` in a manifest."""
    return [mode for mode, cls in LOSS_MODES.items()
            if any((f.alias or name) == alias for name, f in cls.model_fields.items())]
