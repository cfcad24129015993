"""What every config section of the commands shares: a typo fails loudly, a section of one kind among several
(graft-train's `peers.source`, the generator side's `sampler.backend`) takes only its kind's settings, and a key of an
earlier release is refused in one line naming the key that replaced it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator


class Section(BaseModel):
    # A typo in a YAML key must fail loudly, not silently fall back to a default.
    model_config = ConfigDict(extra="forbid")


class KindSection(Section):
    """One kind of a section of several kinds, told apart by the field KIND (its first); SECTION names the section in
    messages. A setting of another kind would do nothing here: refused, naming what this kind takes."""

    SECTION: ClassVar[str] = "sampler"
    KIND: ClassVar[str] = "backend"

    @model_validator(mode="before")
    @classmethod
    def _own_settings_only(cls, data: Any) -> Any:
        if isinstance(data, dict):
            own = set(cls.model_fields)
            foreign = [key for key in data if key not in own]
            if foreign:
                section, kind = cls.SECTION, cls.KIND
                raise ValueError(f"{section}.{f', {section}.'.join(foreign)} with {section}.{kind} {data.get(kind)}: not "
                                 f"a setting of that {kind} (it takes {', '.join(sorted(own - {kind})) or 'none'}); "
                                 "drop it")
        return data


def refuse_moved(data: Any, moved: Mapping[str, str], where: str = "") -> None:
    """ValueError naming, in one line, each key of `data` (a config's mapping, or not one: then nothing) that an earlier
    release had and that `moved` maps to the key that replaced it. where: the section the keys are in ('data.')."""
    if not isinstance(data, dict):
        return
    found = [key for key in moved if key in data]
    if found:
        raise ValueError("; ".join(f"{where}{key}: now {moved[key]}" for key in found)
                         + " (keys of an earlier release: write the new ones)")
