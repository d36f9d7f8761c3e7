"""Test session set-up: simulate 8 CPU devices so the data-parallel tests can build 1-, 2- and
8-device meshes in the same process. The flag must be set before jax is first imported."""
import os

_FLAG = "--xla_force_host_platform_device_count=8"
if "jax" not in __import__("sys").modules and _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
