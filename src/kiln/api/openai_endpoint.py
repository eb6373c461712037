"""The RLJob's settings of the rollout's OpenAI endpoint (`spec.rollout.openai`): who may call
it, what it accepts, and how much one caller may hold.

The endpoint itself is `kiln.services.rollout.openai_server`; the operator turns `apiKeySecret`
and `allowedPeers` into the rollout pod's mounted keys and its NetworkPolicy
(`kiln.operator.children`). Part of the RLJob API; `kiln.api.spec` is the module to import.
"""
from __future__ import annotations

import math

from pydantic import Field, model_validator

from kiln.api.base import Model

#: The rollout service reads its API keys from the file or folder this names, and listens on
#: the address `HOST_ENV` names (default 127.0.0.1).
KEYS_ENV = "KILN_OPENAI_API_KEYS"
HOST_ENV = "KILN_OPENAI_HOST"
#: Behind a router on one machine (`kiln run`): the port a replica's endpoint listens on instead
#: of `openaiPort` (0: any free one; the router holds `openaiPort`), and the file the replica
#: announces its address in, for the router to find.
PORT_ENV = "KILN_OPENAI_PORT"
ANNOUNCE_ENV = "KILN_OPENAI_ANNOUNCE"
#: Where the operator mounts `apiKeySecret` in the rollout container.
KEYS_DIR = "/etc/kiln/openai-keys"
#: Label a pod must carry (value "true") to reach a job's OpenAI endpoint when the job names no
#: `allowedPeers`: only pods of the job's namespace that carry it are admitted.
CLIENT_LABEL = "kiln.dev/openai-client"


class OpenAIPeer(Model):
    """One source admitted to the endpoint's port: a CIDR block, or pods chosen by labels
    (in the job's namespace, or in the namespaces `namespaceLabels` selects)."""

    cidr: str | None = Field(None, pattern=r"^[0-9a-fA-F:.]+/[0-9]{1,3}$")
    """An IP block, e.g. `10.0.0.0/16` (a NetworkPolicy `ipBlock`)."""
    pod_labels: dict[str, str] = Field(default_factory=dict)
    """Pods with all these labels."""
    namespace_labels: dict[str, str] | None = None
    """With `podLabels`: pods in the namespaces with these labels (`{}`: any namespace);
    unset: the job's namespace only."""

    @model_validator(mode="after")
    def _one_kind(self) -> OpenAIPeer:
        if (self.cidr is None) == (not self.pod_labels):
            raise ValueError("an allowed peer is either a `cidr` or `podLabels`, not both or neither")
        if self.namespace_labels is not None and not self.pod_labels:
            raise ValueError("namespaceLabels needs podLabels (which pods of those namespaces)")
        return self


class OpenAIEndpointSpec(Model):
    """Authentication, admission and limits of the OpenAI endpoint (served when
    `rollout.openaiPort` is set). Every request carries `Authorization: Bearer <key>`."""

    api_key_secret: str | None = Field(None, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    """Name of a Secret in the job's namespace whose every entry is one API key (at least 16
    characters); the entry's name names the caller in logs. Mounted read-only into the
    rollout container alone. Required on a cluster when `openaiPort` is set; `kiln run`
    generates a key into `RUN_DIR/openai/api-key` instead."""
    allowed_peers: list[OpenAIPeer] = Field(default_factory=list)
    """Who may connect to the endpoint's port (its NetworkPolicy). Empty: only pods of the
    job's namespace labelled `kiln.dev/openai-client: "true"`."""
    reward_range: list[float] = Field(default_factory=lambda: [-10.0, 10.0], min_length=2,
                                      max_length=2)
    """Rewards outside [low, high] (or not finite) are refused with a 400."""
    max_open_episodes: int = Field(256, ge=1)
    """Episodes one API key may hold open at once; opening another gets a 429."""
    max_body_bytes: int = Field(4 << 20, ge=1 << 16, le=64 << 20)
    """Largest request body accepted; a bigger one gets a 413."""
    idle_seconds: float = Field(900, gt=0)
    """An episode without a call for this long is closed (its tokens are not trained on)."""

    @model_validator(mode="after")
    def _range(self) -> OpenAIEndpointSpec:
        low, high = self.reward_range
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise ValueError(f"rewardRange: expected finite [low, high] with low < high, got "
                             f"{self.reward_range}")
        return self
