"""docs/configuration.md and jax_arx/config.py list the same variables.

The page's table (rows ``| `JAX_ARX_...` |``) and the table of config.py's
docstring must name exactly the variables config.py reads,
``config.VARIABLES`` (tests/test_config_unit.py checks that list against
what ``load()`` asks the environment for). ``config.RETIRED`` the page
names as retired (ignored with a warning), never as settings. A variable
added to or retired from config.py without the page fails here.
"""

from __future__ import annotations

import pathlib
import re

from jax_arx import config

REPO = pathlib.Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "configuration.md"
NAME = r"JAX_ARX_[A-Z0-9_]+"


def _settings() -> set[str]:
    # config.VARIABLES is what load() reads (tests/test_config_unit.py
    # checks it against what load() asks the environment for).
    return set(config.VARIABLES)


def test_the_page_lists_what_config_reads():
    read = _settings()
    documented = set(re.findall(rf"^\| `({NAME})`", PAGE.read_text(), re.M))
    assert read, "found no variable in jax_arx/config.py: has the way it reads them changed?"
    assert not read - documented, f"read by jax_arx/config.py, missing from docs/configuration.md: {read - documented}"
    assert not documented - read, f"in docs/configuration.md, not read by jax_arx/config.py: {documented - read}"


def test_the_docstring_lists_what_config_reads():
    read = _settings()
    listed = set(re.findall(rf"^({NAME})\s", config.__doc__, re.M))
    assert listed == read, f"config.py's docstring table differs: missing {read - listed}, extra {listed - read}"


def test_retired_variables_are_named_as_retired_only():
    text = PAGE.read_text()
    rows = set(re.findall(rf"^\| `({NAME})`", text, re.M))
    for name in config.RETIRED:
        assert name not in rows, f"{name} is retired (config.RETIRED) but docs/configuration.md lists it as a setting"
        assert name in text, f"docs/configuration.md does not say that {name} is retired"
