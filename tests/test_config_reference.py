"""docs/config.md is the schema's reference: complete, described, and never stale."""

from pathlib import Path

from lmppo.inputs.config import Config, SupervisedConfig
from lmppo.inputs.config_reference import SHARED, reference, section_of

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def every_field(model, prefix=""):
    for name, field in model.model_fields.items():
        yield f"{prefix}{name}", field
        section = section_of(field.annotation)
        if section is not None and section not in SHARED:
            yield from every_field(section, f"{prefix}{name}.")


def test_docs_config_md_is_the_schemas_reference():
    assert DOC.read_text() == reference(), (
        "docs/config.md is stale: rewrite it with `python -m lmppo.inputs.config_reference > docs/config.md`"
    )


def test_every_key_is_described_and_listed():
    page = reference()
    for schema in (Config, SupervisedConfig, *SHARED):
        for key, field in every_field(schema):
            section = section_of(field.annotation)
            assert field.description or (section and section.__doc__), f"{key} has no description"
    for key, _ in every_field(Config):
        if "." not in key:  # a section: its heading
            assert f"### `{key}`" in page
            continue
        listed = key.replace("reward.components.", "reward.components[].")
        assert f"| `{listed}` |" in page, f"{key} missing from the reference"
