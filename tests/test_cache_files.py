"""The cache files' rules (mdcli.cache_files): JSON written whole, read forgivingly, file digests
remembered by (path, size, mtime) and dropped with their files."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from mdcli.cache_files import json_digest, read_json_object, remembered_sha256s, replace_json


def test_json_is_written_whole_and_leaves_no_partial_file(tmp_path):
    target = tmp_path / "deeper" / "record.json"
    assert replace_json(target, {"layouts": {"q": 1}})
    assert replace_json(target, {"layouts": {"q": 0}})  # over an existing file
    assert json.loads(target.read_text()) == {"layouts": {"q": 0}}
    assert [p.name for p in target.parent.iterdir()] == ["record.json"]


def test_a_cache_that_cannot_be_written_says_so_instead_of_raising(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    assert replace_json(blocked / "record.json", {"x": 1}) is False


def test_missing_broken_or_non_object_json_reads_as_empty(tmp_path):
    broken, listed = tmp_path / "broken.json", tmp_path / "list.json"
    broken.write_text('{"half": ')
    listed.write_text("[1, 2]")
    assert read_json_object(tmp_path / "absent.json") == {}
    assert read_json_object(broken) == {}
    assert read_json_object(listed) == {}


def test_a_key_depends_on_the_facts_not_their_order():
    assert json_digest({"a": 1, "b": [2, 3]}) == json_digest({"b": [2, 3], "a": 1})
    assert json_digest({"a": 1}) != json_digest({"a": 2})
    assert json_digest({"path": Path("x")}) == json_digest({"path": "x"})  # what JSON cannot hold, as its str
    assert len(json_digest({})) == 32


def test_digests_are_remembered_until_a_file_changes_and_forgotten_with_it(tmp_path):
    memo = tmp_path / "cache" / "digests.json"
    first, second = tmp_path / "a.bin", tmp_path / "b.bin"
    first.write_bytes(b"one")
    second.write_bytes(b"two")
    digests = remembered_sha256s([first, second], memo)
    assert digests == {first: hashlib.sha256(b"one").hexdigest(), second: hashlib.sha256(b"two").hexdigest()}

    stamps = json.loads(memo.read_text())
    stamps[str(first.resolve())]["sha256"] = "f" * 64  # believed while size and mtime match
    memo.write_text(json.dumps(stamps))
    assert remembered_sha256s([first], memo)[first] == "f" * 64

    stat = first.stat()
    os.utime(first, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    second.unlink()
    assert remembered_sha256s([first], memo)[first] == hashlib.sha256(b"one").hexdigest()
    assert set(json.loads(memo.read_text())) == {str(first.resolve())}  # the removed file's entry went


def test_digests_without_a_memo_are_read_every_time(tmp_path):
    blob = tmp_path / "a.bin"
    blob.write_bytes(b"one")
    assert remembered_sha256s([blob], None) == {blob: hashlib.sha256(b"one").hexdigest()}
    assert [p.name for p in tmp_path.iterdir()] == ["a.bin"]
