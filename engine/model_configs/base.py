"""What the model families' configs share: the multi-head latent attention dimensions (a dataclass both
ModelConfig and KimiLinearConfig extend, and engine.layers.mla reads) and the field checks every config uses."""
from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int_fields(config: object, positive: Iterable[str] = (), non_negative: Iterable[str] = (),
                     optional_positive: Iterable[str] = ()) -> None:
    """ValueError naming the first field of `config` that is not an int of the required sign (optional
    ones may also be None)."""
    for name in positive:
        value = getattr(config, name)
        if not _is_int(value) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    for name in non_negative:
        value = getattr(config, name)
        if not _is_int(value) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    for name in optional_positive:
        value = getattr(config, name)
        if value is not None and (not _is_int(value) or value <= 0):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")


def alias(name: str) -> Any:
    """A read-only property returning attribute `name` (dotted names reach into a member: "header.rank"): one
    value under a second name, e.g. another model family's field name."""
    return property(operator.attrgetter(name), doc=f"The same as {name}.")


def length_of(name: str) -> Any:
    """A read-only property returning len(attribute `name`) (dotted names as in alias): a count kept by
    the collection it counts, e.g. num_running = length_of("scheduler.running")."""
    collection = operator.attrgetter(name)
    return property(lambda owner: len(collection(owner)), doc=f"len({name}).")


def check_positive(config: object, names: Iterable[str], owner: str = "") -> None:
    """ValueError naming the first of `names` whose value is not > 0 (NaN included), prefixed by `owner`
    ("CacheShape." -> "CacheShape.num_pages must be positive, got 0")."""
    for name in names:
        value = getattr(config, name)
        if not value > 0:
            raise ValueError(f"{owner}{name} must be positive, got {value}")


def check_expert_groups(config: object, experts: str, per_token: str, groups: str, topk_group: str = "topk_group",
                        grouped_top2: bool = True) -> None:
    """Grouped top-k routing: `per_token` of `experts` experts split in `groups` groups, routed within the best
    `topk_group` groups. grouped_top2 (noaux_tc): groups are scored by their top-2 experts, so each holds at
    least 2 and the chosen groups must hold `per_token` experts. Arguments are field names of `config`, so
    the ValueError names the config's own fields."""
    num_experts, num_per_token = getattr(config, experts), getattr(config, per_token)
    num_groups, num_topk_groups = getattr(config, groups), getattr(config, topk_group)
    if num_per_token > num_experts:
        raise ValueError(f"{per_token}={num_per_token} exceeds {experts}={num_experts}")
    if num_experts % num_groups:
        raise ValueError(f"{groups}={num_groups} does not divide {experts}={num_experts}")
    if num_topk_groups > num_groups:
        raise ValueError(f"{topk_group}={num_topk_groups} exceeds {groups}={num_groups}")
    per_group = num_experts // num_groups
    if grouped_top2:
        if per_group < 2:
            raise ValueError(f"{groups}={num_groups} leaves fewer than 2 experts per group (noaux_tc scores top-2)")
        if num_per_token > num_topk_groups * per_group:
            raise ValueError(f"{per_token}={num_per_token} exceeds the experts in {topk_group} groups")


@dataclass(frozen=True)
class MLAShape:
    """Multi-head latent attention dimensions (field names are the checkpoints' config.json names).
    Subclasses validate them with MLA_POSITIVE / MLA_OPTIONAL_POSITIVE in their own __post_init__."""

    hidden_size: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Entries per token per layer in the latent cache: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim ** -0.5 (a config with rope scaling overrides it)."""
        return self.qk_head_dim ** -0.5


MLA_POSITIVE = ("hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim")
MLA_OPTIONAL_POSITIVE = ("q_lora_rank",)
