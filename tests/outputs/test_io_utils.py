"""The output file a command writes when it ends, checked when it starts (`io_utils`)."""

import argparse
import os

import pytest

from alma_jax.outputs import io_utils


def test_a_file_that_can_be_written_is_no_problem_and_its_missing_folder_is_made(tmp_path):
  assert io_utils.output_file_problem("--out", None) is None
  assert io_utils.output_file_problem("--out", "") is None  # no file asked for
  path = tmp_path / "new" / "deeper" / "r.json"
  assert io_utils.output_file_problem("--out", str(path)) is None
  assert path.parent.is_dir() and not path.exists()  # the folder, not the file
  path.write_text("{}")
  assert io_utils.output_file_problem("--out", str(path)) is None  # rewritten at the end


def test_a_folder_a_file_in_the_way_and_a_read_only_place_are_named(tmp_path, monkeypatch):
  assert io_utils.output_file_problem("--json", str(tmp_path)) == (
      f"--json={tmp_path} is a directory; give the file to write")
  blocker = tmp_path / "notes.txt"
  blocker.write_text("mine")
  path = blocker / "sub" / "r.json"
  assert io_utils.output_file_problem("--out", str(path)) == (
      f"--out={path}: its folder {blocker / 'sub'} cannot be made: {blocker} is a file")
  assert blocker.read_text() == "mine"
  monkeypatch.setattr(os, "access", lambda p, mode: False)  # as for a user without the right
  assert io_utils.output_file_problem("--out", str(tmp_path / "r.json")) == (
      f"--out={tmp_path / 'r.json'} is not writable")


def test_the_parser_reports_the_problem_in_one_line_with_exit_code_2(tmp_path, capsys):
  parser = argparse.ArgumentParser(prog="bench.py")
  io_utils.check_output_file(parser, "--out", str(tmp_path / "ok.json"))
  with pytest.raises(SystemExit) as info:
    io_utils.check_output_file(parser, "--out", str(tmp_path))
  assert info.value.code == 2
  assert capsys.readouterr().err.splitlines()[-1] == (
      f"bench.py: error: --out={tmp_path} is a directory; give the file to write")
