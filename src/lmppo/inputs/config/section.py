"""What every section of a config is: a strict pydantic model (unknown keys are errors, assignments are
validated), and the dtypes a model's weights may have."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

Dtype = Literal["float32", "bfloat16", "float16"]


class Section(BaseModel):
    """Base of every section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
