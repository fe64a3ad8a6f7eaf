"""The background thread that computes what a run needs later (FLOP counts)."""

import contextvars
import threading

import pytest

from alma_jax.runtime import background

_FLAG = contextvars.ContextVar("test_background_flag", default="unset")


def test_work_runs_on_another_thread_in_order_of_submission():
  gate, seen = threading.Event(), []

  def first():
    gate.wait(timeout=30)  # held until the caller has submitted the second one
    seen.append("first")
    return threading.get_ident()

  a = background.later(first)
  b = background.later(lambda: seen.append("second") or threading.get_ident())
  assert not a.done() and not b.done()
  gate.set()
  assert b.result() == a.result() != threading.get_ident()
  assert seen == ["first", "second"] and a.done()


def test_work_sees_the_callers_context_variables_as_they_were_when_submitted():
  token = _FLAG.set("caller")
  try:
    pending = background.later(_FLAG.get)
  finally:
    _FLAG.reset(token)
  assert pending.result() == "caller"


def test_an_error_is_raised_in_the_thread_that_asks_for_the_result():
  def fails(x):
    raise ValueError(f"bad {x}")

  pending = background.later(fails, 3)
  with pytest.raises(ValueError, match="bad 3"):
    pending.result()
  assert background.later(lambda x: x + 1, 1).result() == 2  # the thread serves on
  assert background.value(5) == 5 and background.value(background.later(int, "7")) == 7
