"""The ``reward`` section: one source (a reward model, a function or a server's URL) with its
preprocessing, or several weighted components with an optional gate; and the check of a server's URL."""

from __future__ import annotations

from pydantic import Field, model_validator

from lmppo.inputs.config.models import ModelSource
from lmppo.inputs.config.section import Section


class RewardSource(Section):
    """One reward: a learned reward model, a programmatic ``module:function`` *or* a reward server's URL, and its preprocessing
    (in this order: missing-EOS penalty, running normalisation, clip)."""

    model: ModelSource | None = Field(
        None,
        description="a learned reward model (sequence classification), read with its own tokenizer and template",
    )
    function: str | None = Field(
        None,
        description="'package.module:function' or 'path/to/file.py:function' taking (prompts, responses)",
    )
    url: str | None = Field(
        None,
        description="a reward server (`lmppo serve-rm`, or any speaking its JSON: docs/rewards.md): "
        "POSTed prompts and responses, answering one reward per response",
    )
    url_timeout_s: float = Field(
        30.0,
        gt=0,
        description="reward.url: seconds a whole request may take (connect, send, the whole answer), however "
        "slowly the server answers",
    )
    url_retries: int = Field(
        3,
        ge=0,
        description="reward.url: retries of a request that failed in transit, timed out or got HTTP 5xx, after "
        "pauses of 0.5, 1, 2, ... s",
    )
    url_token_env: str = Field(
        "LMPPO_REWARD_TOKEN",
        description="reward.url: the environment variable holding the server's bearer token (sent when set; "
        "never written to a file)",
    )
    url_proxy: str | None = Field(
        None, description="reward.url: an HTTP proxy to reach the server through (none unless set here)"
    )
    batch_size: int = Field(16, gt=0, description="rows per reward-model forward, function call or request")
    batch_tokens: int | None = Field(
        None,
        gt=0,
        description="a token budget per reward-model forward instead of batch_size rows: inputs grouped by "
        "length, at most this many of the RM's tokens each (padding included)",
    )
    max_length: int | None = Field(None, gt=0, description="truncate RM inputs (its own tokens)")
    missing_eos_penalty: float | None = Field(
        None,
        description="subtracted from the score of truncated rows (no stop token); needs rollout.truncation=terminal",
    )
    clip: float | None = Field(None, gt=0, description="clip scores to [-clip, clip]")
    normalize: bool = Field(False, description="running mean/std normalisation of scores")

    @model_validator(mode="after")
    def _url_is_plain_http(self) -> RewardSource:
        if self.url is not None:
            check_reward_url(self.url)
        return self

    @property
    def source_count(self) -> int:
        """How many of model, function and url are set (a source needs exactly one)."""
        return sum(value is not None for value in (self.model, self.function, self.url))


SOURCE_KEYS = tuple(RewardSource.model_fields)


def check_reward_url(url: str) -> None:
    """A reward server's URL: http or https to a host and a port a connection can name, with no credentials
    in it (they would be written to config.yaml and every checkpoint's manifest, and echoed in errors)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
    except ValueError as err:  # an unclosed [ of an IPv6 address; not echoed, it may hold credentials
        raise ValueError(f"reward.url is no URL ({err}); give one like http://host:8000/score") from None
    if parts.username or parts.password:
        raise ValueError(
            "reward.url holds credentials (user:password@), which would be written to config.yaml and every "
            "checkpoint: remove them and put the server's token in the environment variable "
            "reward.url_token_env names (LMPPO_REWARD_TOKEN)"
        )
    if parts.scheme not in ("http", "https"):
        raise ValueError(
            f"reward.url {url!r} is not an http(s) URL of a server; give one like http://host:8000/score"
        )
    if not parts.hostname:
        raise ValueError(
            f"reward.url {url!r} names no host; give the server's address, like http://host:8000/score"
        )
    try:
        port = parts.port
    except ValueError:  # not a number, or past 65535
        port = 0
    if port == 0:
        raise ValueError(
            f"reward.url {url!r} has the port {parts.netloc.rpartition(':')[2]!r}, which no server listens on: "
            "a port is a number from 1 to 65535; give the server's (lmppo serve-rm --port), like "
            "http://host:8000/score"
        )


class RewardComponent(RewardSource):
    """One of several rewards (``reward.components``): its weighted, preprocessed score is summed."""

    name: str = Field(
        pattern=r"^[A-Za-z0-9_-]+$", description="names its metrics: reward/<name>/raw, reward/<name>/used"
    )
    weight: float = Field(1.0, description="its preprocessed score's weight in the sum")

    @model_validator(mode="after")
    def _exactly_one_source(self) -> RewardComponent:
        if self.source_count != 1:
            raise ValueError(f"reward component {self.name!r}: set exactly one of model, function or url")
        return self


class RewardGate(Section):
    """Llama 2's safety gate: rows whose ``component`` scores (raw) below ``below`` get that component's
    preprocessed score alone instead of the weighted sum."""

    component: str = Field(description="the name of the gating component")
    below: float = Field(description="raw score under which a row gets the gating component's score alone")


NO_SINGLE_SOURCE = (
    "set exactly one of reward.model (a reward model), reward.function ('module:fn') or reward.url (a reward "
    "server), or a list of reward.components"
)


class RewardConfig(RewardSource):
    """The reward: one source (``model`` or ``function``, with its preprocessing here), or ``components``,
    several weighted sources each with its own preprocessing (and an optional ``gate``); or none, when an
    environment's turn rewards are the whole reward (:func:`lmppo.inputs.resolve.check_reward_source`)."""

    components: list[RewardComponent] = []
    gate: RewardGate | None = None
    overlong_buffer: int | None = Field(
        None,
        gt=0,
        description="DAPO's overlong shaping: over the last N tokens before the length limit "
        "(rollout.max_new_tokens; an episode's max_total_tokens) the score loses overlong_penalty x the "
        "share of those N tokens used, all of it at the limit; null = off",
    )
    overlong_penalty: float = Field(1.0, gt=0, description="what reward.overlong_buffer takes at the limit")

    @model_validator(mode="after")
    def _one_shape(self) -> RewardConfig:
        if not self.components:
            if self.source_count > 1:
                raise ValueError(NO_SINGLE_SOURCE)
            if self.gate is not None:
                raise ValueError("reward.gate picks between reward.components; list the components first")
            return self
        beside = [key for key in SOURCE_KEYS if getattr(self, key) != RewardSource.model_fields[key].default]
        if beside:
            raise ValueError(
                f"reward.components is set, so reward.{beside[0]} has no source to apply to; move "
                f"{', '.join(f'reward.{key}' for key in beside)} into each component"
            )
        names = [component.name for component in self.components]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(
                f"reward.components: the name {twice[0]!r} is used twice; give each a unique name"
            )
        if self.gate is not None and self.gate.component not in names:
            raise ValueError(
                f"reward.gate.component={self.gate.component!r} is not one of the components {names}"
            )
        return self

    @property
    def configured(self) -> bool:
        """Whether a reward source is set; without one the final reward is 0 (an environment's alone)."""
        return bool(self.components) or self.source_count == 1

    @property
    def learned(self) -> bool:
        """Whether reward models give the whole score: its words are then "RM score", else "reward"."""
        return self.configured and all(source.model is not None for source in self.sources())

    def score_name(self, episodes: bool) -> str:
        """The reward's name in displays: "environment reward" with no source, "RM score" when reward models
        give all of it (no environment adding turn rewards), else "reward"."""
        if not self.configured:
            return "environment reward"
        return "RM score" if self.learned and not episodes else "reward"

    def sources(self) -> list[RewardComponent]:
        """The components; the one-source shorthand is one component named "reward" of weight 1; none
        without a source."""
        if self.components or not self.configured:
            return list(self.components)
        return [RewardComponent(name="reward", **{key: getattr(self, key) for key in SOURCE_KEYS})]
