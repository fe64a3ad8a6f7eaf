"""The flags of a multi-process run checked before it starts (alma_jax/runtime/multihost.py)."""

import pytest

from alma_jax.runtime import multihost


@pytest.mark.parametrize("start, flags, message", [
    (False, {"num_processes": 2}, "--num_processes=2: these flags set up a multi-process run; "
     "add --jax_distributed (or set config.mesh.distributed=yes)"),
    (False, {"coordinator_address": "h:1", "process_id": 0},
     "--coordinator_address=h:1 --process_id=0: these flags set up a multi-process run"),
    (True, {"num_processes": 0}, "--num_processes=0 must be >= 1"),
    (True, {"num_processes": 2, "process_id": 2}, "--process_id=2 must be from 0 to 1"),
    (True, {"process_id": -1}, "--process_id=-1 must be from 0 to --num_processes - 1"),
    (True, {"coordinator_address": "10.0.0.1"}, "--coordinator_address='10.0.0.1' must be "
     "host:port, e.g. 10.0.0.1:1234 (a port from 1 to 65535)"),
    (True, {"coordinator_address": "h:0"}, "--coordinator_address='h:0' must be host:port"),
    (True, {"coordinator_address": ":1234"}, "--coordinator_address=':1234' must be host:port"),
    (True, {"coordinator_address": "h:99999"}, "--coordinator_address='h:99999' must be"),
], ids=["not_distributed", "not_distributed_two", "no_processes", "id_too_large", "id_negative",
        "no_port", "port_0", "no_host", "port_too_large"])
def test_process_flags_that_cannot_start_a_run_are_refused_by_name(start, flags, message):
  with pytest.raises(ValueError) as info:
    multihost.check_flags(start, **flags)
  assert str(info.value).startswith(message), str(info.value)


@pytest.mark.parametrize("flags", [
    {}, {"coordinator_address": "10.0.0.1:1234", "num_processes": 2, "process_id": 1},
    {"coordinator_address": "[::1]:80"}, {"num_processes": 1}])
def test_process_flags_of_a_run_pass(flags):
  multihost.check_flags(True, **flags)
  if not flags:
    multihost.check_flags(False)


@pytest.mark.parametrize("value, refused", [("1", False), ("0", False), ("", False),
                                             ("yes", True), ("2", True)])
def test_alma_jax_distributed_is_1_0_or_unset(value, refused, monkeypatch):
  monkeypatch.setenv("ALMA_JAX_DISTRIBUTED", value)
  if not refused:
    multihost.check_flags(True)
    return
  with pytest.raises(ValueError, match=rf"^ALMA_JAX_DISTRIBUTED='{value}' in the environment: "
                                       r"allowed values '1' \(a multi-process run\) and '0'"):
    multihost.check_flags(False)
