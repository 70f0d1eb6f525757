"""The devices a setting (``SPECBATCH_DEVICE``) or ``--device`` may name, one pattern for both: the
settings check it without importing torch, the engine (``loading.parse_device``) before torch reads
the name."""

from __future__ import annotations

import re

# An index is 0..127 without leading zeros, as torch parses one: it reads cuda:128 as cuda:-128 and
# refuses cuda:01.
DEVICE_NAME = re.compile(r"cpu|mps|cuda(:(0|[1-9]\d?|1[01]\d|12[0-7]))?")
DEVICE_HINT = "use cpu, cuda, cuda:N or mps"
