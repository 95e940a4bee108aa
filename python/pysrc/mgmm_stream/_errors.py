"""The exceptions mgmm_stream raises. Each carries the engine's message, the same text the CLI
prints: it names the file, key or tile concerned and says what to do.

* ``MgmmError`` — base of everything below.
* ``BadInputError`` (also a ``ValueError``) — wrong shapes or dtypes, a bad plan, a file that is
  not a matrix, an unsupported array layout.
* ``DeviceError`` (also a ``RuntimeError``) — a GPU or compute backend failed.
* ``StorageError`` (also an ``OSError``) — reading or writing a file failed, or a checksum did
  not match.
* ``CancelledError`` — the call's ``cancel`` event was set. (Ctrl-C raises the ordinary
  ``KeyboardInterrupt``.)
"""


class MgmmError(Exception):
    """Base class of every mgmm_stream error."""


class BadInputError(MgmmError, ValueError):
    """The inputs, the plan or the arguments cannot be used as given."""


class DeviceError(MgmmError, RuntimeError):
    """A GPU or the compute backend failed."""


class StorageError(MgmmError, OSError):
    """Reading or writing a file failed, or stored data is corrupt."""


class CancelledError(MgmmError):
    """The call was cancelled through its ``cancel`` event; a file output stays resumable."""
