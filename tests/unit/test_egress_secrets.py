"""The secrets file: its form, its checks, placeholders, and values kept out of messages."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcp_code_sandbox.egress import SecretsFileError, load_secrets, placeholder, placeholder_env
from mcp_code_sandbox.settings import load_settings

VALUE = "sk-live-REALVALUE-0123456789"
GOOD = f"""
[secrets.EXAMPLE_API_KEY]
value = "{VALUE}"
hosts = ["api.example.test", "*.example.net"]

[secrets.GH_TOKEN]
value = "ghp-other"
hosts = ["API.github.test."]
header = "Authorization: token {{value}}"
"""


def write(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / "secrets.toml"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_a_good_file_loads(tmp_path: Path) -> None:
    first, second = load_secrets(write(tmp_path, GOOD), key=b"k" * 32)
    assert first.name == "EXAMPLE_API_KEY"
    assert first.hosts == ("api.example.test", "*.example.net")
    assert first.header == "Authorization: Bearer {value}"  # the default
    assert first.header_value() == f"Bearer {VALUE}"
    assert first.is_for("api.example.test") and first.is_for("x.example.net")
    assert not first.is_for("example.net") and not first.is_for("api.example.test.evil")
    assert second.hosts == ("api.github.test",)
    assert second.header_name == "Authorization"
    assert second.header_value() == "token ghp-other"


def test_placeholders_are_stable_per_key_and_distinct(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    one = load_secrets(path, key=b"a" * 32)
    again = load_secrets(path, key=b"a" * 32)
    other_key = load_secrets(path, key=b"b" * 32)
    assert placeholder(one[0]) == placeholder(again[0])
    assert placeholder(one[0]) != placeholder(other_key[0])
    assert placeholder(one[0]) != placeholder(one[1])
    assert placeholder(one[0]).startswith("mcsph_")
    assert VALUE not in placeholder(one[0])
    assert placeholder_env(one) == {
        "EXAMPLE_API_KEY": placeholder(one[0]),
        "GH_TOKEN": placeholder(one[1]),
    }


def test_the_value_is_never_in_a_repr(tmp_path: Path) -> None:
    secrets = load_secrets(write(tmp_path, GOOD))
    assert VALUE not in repr(secrets)
    assert VALUE not in str(secrets)


def test_a_file_others_may_read_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SecretsFileError, match="chmod 600") as caught:
        load_secrets(write(tmp_path, GOOD, 0o644))
    assert caught.value.code == "invalid_argument"


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(SecretsFileError, match=r"missing\.toml"):
        load_secrets(tmp_path / "missing.toml")


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (f'[secrets.K]\nvalue = "{VALUE}"\nhosts = "api.test"', "'hosts' must be a non-empty list"),
        (f'[secrets.K]\nvalue = "{VALUE}"\nhosts = []', "'hosts' must be a non-empty list"),
        (f'[secrets.K]\nvalue = "{VALUE}"\nhosts = ["http://x/"]', "is not a host name"),
        ('[secrets.K]\nvalue = ""\nhosts = ["a.test"]', "'value' must be a non-empty string"),
        (f'[secrets.K]\nvalue = "{VALUE}\\n"\nhosts = ["a.test"]', "one line"),
        (
            f'[secrets.K]\nvalue = "{VALUE}"\nhosts = ["a.test"]\nheader = "Bearer"',
            "'header' must look like",
        ),
        (
            f'[secrets.K]\nvalue = "{VALUE}"\nhosts = ["a.test"]\nheader = "X Y: {{value}}"',
            "invalid header name",
        ),
        (f'[secrets.K]\nvalue = "{VALUE}"\nhosts = ["a.test"]\nport = 1', "unknown keys"),
        (f'[secrets."1BAD"]\nvalue = "{VALUE}"\nhosts = ["a.test"]', "environment variable name"),
        (f'[other]\nvalue = "{VALUE}"', "unknown top-level keys"),
        (f'[secrets.K]\nvalue = "{VALUE}', "not valid TOML"),
    ],
)
def test_bad_files_say_what_is_wrong_without_the_value(
    tmp_path: Path, text: str, says: str
) -> None:
    with pytest.raises(SecretsFileError) as caught:
        load_secrets(write(tmp_path, text))
    assert says in caught.value.message
    assert "REALVALUE" not in str(caught.value)


def test_settings_take_the_file_and_an_empty_value_is_unset(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    assert load_settings(environ={"SANDBOX_SECRETS_FILE": str(path)}).secrets_file == path
    assert load_settings(environ={"SANDBOX_SECRETS_FILE": ""}).secrets_file is None
