"""The ``tierckpt`` command: look at, check, move and export stored checkpoints.

Every command takes tier URLs: a local folder (``/nvme/run1``, ``file:///nvme/run1``) or
``s3://bucket/prefix`` (with ``--endpoint-url`` or ``AWS_ENDPOINT_URL`` for S3-compatible
servers; credentials from boto3's usual chain). Exit status: 0 success, 1 failure (missing
checkpoint, corrupt data, storage error), 2 usage error. ``--debug`` shows tracebacks and
tierckpt's debug log; botocore's wire log (request headers, including session tokens) only with
``--debug-botocore`` or ``TIERCKPT_DEBUG_BOTOCORE=1``. Messages never show the credentials of an
endpoint URL (``http://KEY:SECRET@host`` is printed as ``http://***@host``).

Behind this module, one per command group: ``_inspect`` (``ls``, ``inspect``, ``verify``),
``_manage`` (``pull``, ``push``, ``gc``, ``unlock``, ``export``), ``_tools`` (``bench``,
``demo``); ``_common`` holds what they share, ``_main`` the parser and :func:`main`.
"""

from __future__ import annotations

from tierckpt.cli._main import (
    build_parser,
    main,
)

# importable from here before this module became a package; not public API (`as`: exported)
# isort: off
from tierckpt.cli._common import (
    UsageError as UsageError,
    WIRE_LOGGERS as WIRE_LOGGERS,
    configure_logging as configure_logging,
    fmt_bytes as fmt_bytes,
    fmt_time as fmt_time,
    open_url as open_url,
    opened as opened,
    progress_bar as progress_bar,
    table as table,
    wire_debug_requested as wire_debug_requested,
)
from tierckpt.cli._inspect import (
    cmd_inspect as cmd_inspect,
    cmd_ls as cmd_ls,
    cmd_verify as cmd_verify,
)
from tierckpt.cli._manage import (
    cmd_export as cmd_export,
    cmd_gc as cmd_gc,
    cmd_pull as cmd_pull,
    cmd_push as cmd_push,
    cmd_unlock as cmd_unlock,
)
from tierckpt.cli._tools import (
    cmd_bench as cmd_bench,
    cmd_demo as cmd_demo,
)
# isort: on

__all__ = ["build_parser", "main"]
