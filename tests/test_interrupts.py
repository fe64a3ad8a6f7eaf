"""Tests of the signal handling of a run (alma_jax/interrupts.py)."""

import os
import signal

import jax
import jax.numpy as jnp
import pytest

from alma_jax import interrupts


def _term_from_a_callback(x):
  """A compiled function whose host callback sends this process SIGTERM."""
  def send():
    os.kill(os.getpid(), signal.SIGTERM)

  jax.debug.callback(send)
  return x + 1


def test_a_signal_inside_a_jax_callback_stops_at_the_next_check():
  with interrupts.Signals() as signals, signals.deferred():
    out = jax.jit(_term_from_a_callback)(jnp.float32(1.0))
    jax.effects_barrier()
    assert float(out) == 2.0  # the compiled call completed: nothing was raised inside JAX
    assert signals.pending == signal.SIGTERM
    with pytest.raises(interrupts.RunInterrupted) as info:
      signals.check()
  assert info.value.exit_code == 128 + signal.SIGTERM


def test_outside_deferred_sections_a_signal_raises_at_once_and_writes_finish_first():
  with interrupts.Signals() as signals:
    with pytest.raises(interrupts.RunInterrupted):
      os.kill(os.getpid(), signal.SIGINT)
      for _ in range(10 ** 6):  # the handler raises at the next bytecode
        pass
    signals.pending = None
    done = []
    with pytest.raises(interrupts.RunInterrupted):
      with signals.critical():
        os.kill(os.getpid(), signal.SIGTERM)
        done.append("write finished")
    assert done == ["write finished"]
