"""The agent's own exceptions. Foreign exceptions (pynvml's, OSError, pydantic's) are mapped
to these at the module that talks to the foreign library, with ``raise ... from``.

    GpuledgerError
    ├── BadInputError            exit code 2: a bad config, scenario or argument
    │   └── ConfigError
    └── DeviceError              a call into the GPU driver failed: agent/devices/backend.py
                                 draws that branch (lost device, driver gone, no such reading)
"""

from __future__ import annotations


class GpuledgerError(Exception):
    """Base of everything gpuledger raises on purpose."""


class BadInputError(GpuledgerError):
    """Input that a person must fix: the message names what was wrong and where."""


class ConfigError(BadInputError):
    """A configuration file or environment variable that does not validate."""
