"""The installed version of vllm-supervisor."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

try:
    __version__ = _version("vllm-supervisor")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
