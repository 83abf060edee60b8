"""The JSON the OpenAI API speaks, as types: what json.loads gives back and json.dumps takes."""
from __future__ import annotations

from typing import Union

JsonValue = Union[None, bool, int, float, str, list["JsonValue"], dict[str, "JsonValue"]]
JsonObject = dict[str, JsonValue]
