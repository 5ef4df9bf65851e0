"""The JSON files users hand the tools: read by one owner, whose errors name the file, what it was given as and
what it should hold (rename map, sharding spec, stage map, parameter order)."""

from __future__ import annotations

import re

import pytest

from nxd_ckpt.tools.export import RenameMap
from nxd_ckpt.tools.model_source import read_sharding_spec
from nxd_ckpt.tools.user_files import read_json_object


def test_a_json_object_is_returned(tmp_path):
    path = tmp_path / "spec.json"
    path.write_text('{"*.weight": 0}')
    assert read_json_object(str(path), "sharding spec", "an object") == {"*.weight": 0}


@pytest.mark.parametrize(
    ("text", "says"),
    [(None, "could not be read as JSON"), ("{not json", "could not be read as JSON"), ("[1, 2]", "must be an object")],
)
def test_an_unreadable_or_non_object_file_is_named_with_what_it_was(tmp_path, text, says):
    path = tmp_path / "map.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(f"stage map {path} {says}")):
        read_json_object(str(path), "stage map", "an object")


def test_the_tools_word_their_files_errors_through_it(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[]")
    with pytest.raises(ValueError, match=re.escape(f"rename map {path} must be a JSON object")):
        RenameMap.from_file(str(path))
    expected = f"sharding spec {path} must be a JSON object of name pattern -> partition dim"
    with pytest.raises(ValueError, match=re.escape(expected)):
        read_sharding_spec(str(path))
