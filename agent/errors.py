"""The agent's own exceptions. Foreign exceptions (pynvml's, OSError, pydantic's) are mapped
to these at the module that talks to the foreign library, with ``raise ... from``.

    GpuledgerError
    ├── BadInputError            exit code 2: a bad config, scenario or argument
    │   └── ConfigError
    └── NvmlError                a call into NVML failed; .call and .error name it
        ├── NvmlLibraryMissing   libnvidia-ml.so.1 cannot be loaded (no driver on this host)
        ├── NvmlDriverUnavailable the driver is not loaded / went away: re-initialise later
        ├── NvmlNotSupported     this device has no such reading (learned once, then skipped)
        ├── NvmlFunctionMissing  the driver is older than the call: fall back
        ├── NvmlNotFound         nothing to report (e.g. no utilization samples yet)
        └── NvmlGpuLost          the GPU fell off the bus or needs a reset
"""

from __future__ import annotations


class GpuledgerError(Exception):
    """Base of everything gpuledger raises on purpose."""


class BadInputError(GpuledgerError):
    """Input that a person must fix: the message names what was wrong and where."""


class ConfigError(BadInputError):
    """A configuration file or environment variable that does not validate."""


class NvmlError(GpuledgerError):
    def __init__(self, call: str, error: str, detail: str = "") -> None:
        self.call = call
        self.error = error
        super().__init__(f"{call}: {error}" + (f" ({detail})" if detail else ""))


class NvmlLibraryMissing(NvmlError):
    pass


class NvmlDriverUnavailable(NvmlError):
    pass


class NvmlNotSupported(NvmlError):
    pass


class NvmlFunctionMissing(NvmlError):
    pass


class NvmlNotFound(NvmlError):
    pass


class NvmlGpuLost(NvmlError):
    pass
