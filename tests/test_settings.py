"""Settings: precedence, parsing, errors, and docs/settings.md kept current."""
from __future__ import annotations

from pathlib import Path

import pytest

from ina_collectives.settings import Settings, page, table


def test_keyword_beats_environment_beats_default():
    env = {"INA_TIMEOUT": "12.5", "INA_RING_CHUNK_BYTES": "64K"}
    s = Settings.load({"timeout": 3}, environ=env)
    assert s.timeout == 3.0
    assert s.ring_chunk_bytes == 64 * 1024
    assert s.ring_min_bytes == Settings().ring_min_bytes


@pytest.mark.parametrize("text, value", [("65536", 65536), ("2M", 2 << 20), ("1MiB", 1 << 20),
                                         ("3g", 3 << 30), ("8KB", 8192)])
def test_sizes_accept_suffixes(text, value):
    assert Settings.load(environ={"INA_RING_MIN_BYTES": text}).ring_min_bytes == value


@pytest.mark.parametrize("text, value", [("0", False), ("off", False), ("Yes", True),
                                         ("1", True)])
def test_booleans(text, value):
    assert Settings.load(environ={"INA_INTERNAL_CHECK_AGREEMENT": text}).check_agreement is value


@pytest.mark.parametrize("env, message", [
    ({"INA_TIMEOUT": "soon"}, "INA_TIMEOUT: cannot read 'soon' as float"),
    ({"INA_TIMEOUT": "-1"}, "INA_TIMEOUT='-1': timeout must be > 0"),
    ({"INA_INTERNAL_CHECK_AGREEMENT": "maybe"}, "INA_INTERNAL_CHECK_AGREEMENT"),
    ({"INA_RING_CHUNK_BYTES": "0"}, "INA_RING_CHUNK_BYTES='0': ring_chunk_bytes must be >= 1"),
    ({"INA_LOG_LEVEL": "loud"}, "log_level"),
])
def test_bad_values_name_the_setting(env, message):
    with pytest.raises(ValueError, match=message):
        Settings.load(environ=env)


def test_unknown_keyword_is_named():
    with pytest.raises(TypeError, match="no_such"):
        Settings.load({"no_such": 1}, environ={})


def test_docs_table_is_current():
    doc = (Path(__file__).parent.parent / "docs" / "settings.md").read_text()
    assert doc == page(), ("docs/settings.md is stale: python -m ina_collectives.settings "
                           "> docs/settings.md")
    assert table() in doc and table(internal=True) in doc


def test_an_unknown_variable_is_warned_about_once_with_the_closest_name(caplog):
    env = {"INA_SWITCH_VALUE_BIT": "16", "INA_XYZZY": "1"}
    with caplog.at_level("WARNING", logger="ina_collectives"):
        Settings.load(environ=env)
        Settings.load(environ=env)  # once per process
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "INA_SWITCH_VALUE_BIT is set but is no setting of ina_collectives: ignored (did you "
        "mean INA_SWITCH_VALUE_BITS?)",
        "INA_XYZZY is set but is no setting of ina_collectives: ignored "
        "(python -m ina_collectives.settings lists them)"], lines


def test_an_unknown_variable_is_warned_about_by_rank_0_only(caplog):
    with caplog.at_level("WARNING", logger="ina_collectives"):
        Settings.load(environ={"INA_SWITCH_SLOT": "4", "PMI_RANK": "1"})
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_a_keyword_error_names_the_keyword_not_a_variable():
    with pytest.raises(ValueError, match=r"^timeout must be > 0"):
        Settings.load({"timeout": -1}, environ={"INA_TIMEOUT": "5"})
