"""What a user reads: a warning is one plain line, not Python's ``file:line: UserWarning`` and a line of
lmppo's source; other libraries' warnings keep Python's format."""

import warnings

import pytest

from lmppo import errors
from lmppo.errors import LmppoWarning, warn


@pytest.fixture
def shown(monkeypatch):
    """Warnings shown as outside a test (pytest records them instead), always, through lmppo's hook."""
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        monkeypatch.setattr(warnings, "showwarning", errors._show_warning)
        yield


def test_a_warning_reads_as_one_plain_line(shown, capsys):
    warn("the checkpoint was written by 2 ranks")
    assert capsys.readouterr().err == "warning: the checkpoint was written by 2 ranks\n"


def test_other_warnings_go_to_pythons_own_display(shown, monkeypatch, capsys):
    passed_on = []
    monkeypatch.setattr(
        errors, "_python_show_warning", lambda message, category, *rest: passed_on.append(category)
    )
    warnings.warn("from another library", DeprecationWarning, stacklevel=1)
    assert passed_on == [DeprecationWarning] and capsys.readouterr().err == ""


def test_lmppo_warnings_can_still_be_filtered_or_raised():
    with warnings.catch_warnings():
        warnings.simplefilter("error", LmppoWarning)
        with pytest.raises(LmppoWarning, match="noted"):
            warn("noted")
    assert issubclass(LmppoWarning, UserWarning)  # `-W ignore::UserWarning` silences it too


def test_tables_keep_their_width_outside_a_terminal(capsys, monkeypatch):
    """Printed to a file or a scheduler's log, a wide table is not cut at rich's 80 columns."""
    from rich.table import Table

    from lmppo.errors import console

    monkeypatch.delenv("COLUMNS", raising=False)
    table = Table()
    for i in range(12):
        table.add_column(f"column {i}")
    table.add_row(*(f"{i}.123456" for i in range(12)))
    console().print(table)
    out = capsys.readouterr().out
    assert "11.123456" in out and "…" not in out
