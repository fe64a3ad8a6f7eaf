"""This process's XLA_FLAGS read and edited (alma_jax/runtime/xla_flags.py)."""

from alma_jax.runtime import xla_flags

FLAGS = "--xla_a=1 --xla_b --xla_ab=3 --xla_a=2"


def test_values_are_the_flags_values_in_order_by_whole_name():
  assert xla_flags.values("--xla_a", FLAGS) == ["1", "2"]  # XLA takes the last
  assert xla_flags.values("--xla_b", FLAGS) == [""]  # given without a value
  assert xla_flags.values("--xla_ab", FLAGS) == ["3"]  # not a flag whose name begins --xla_a
  assert xla_flags.values("--xla_c", FLAGS) == []


def test_values_read_this_process_s_xla_flags_by_default(monkeypatch):
  monkeypatch.setenv(xla_flags.ENV, FLAGS)
  assert xla_flags.values("--xla_a") == ["1", "2"]
  monkeypatch.delenv(xla_flags.ENV)
  assert xla_flags.current() == "" and xla_flags.values("--xla_a") == []


def test_replaced_drops_every_value_of_the_named_flags_and_appends_the_new_ones():
  assert xla_flags.replaced(FLAGS, ["--xla_a", "--xla_b"], ["--xla_a=5"]) == "--xla_ab=3 --xla_a=5"
  assert xla_flags.replaced("", ["--xla_a"], []) == ""
  assert xla_flags.replaced(FLAGS, [], []) == FLAGS


def test_replace_edits_this_process_s_xla_flags(monkeypatch):
  monkeypatch.setenv(xla_flags.ENV, FLAGS)
  xla_flags.replace(["--xla_a"], ["--xla_a=7", "--xla_d=0"])
  assert xla_flags.current() == "--xla_b --xla_ab=3 --xla_a=7 --xla_d=0"
  monkeypatch.delenv(xla_flags.ENV)
  xla_flags.replace(["--xla_a"], ["--xla_a=1"])
  assert xla_flags.current() == "--xla_a=1"
