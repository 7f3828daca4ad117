"""The names of grpo's checkpoint format: what a checkpoint root and a checkpoint directory hold.

A root holds checkpoint directories ``step-XXXXXXXX`` (`PREFIX` and the step, 8 digits), the text
file ``latest`` (the newest one's name) and, while a save runs or after a crash, leftovers named
``.tmp-*`` (`TMP_PREFIX`). A checkpoint directory holds `POLICY_FILE`, `REFERENCE_FILE` (when the
trainer has a reference policy), `STATE_FILE` and `STATE_JSON` (format `FORMAT`, version `VERSION`).
"""

from __future__ import annotations

FORMAT = "grpo-checkpoint"
VERSION = 1
PREFIX = "step-"
TMP_PREFIX = ".tmp-"
LATEST = "latest"
STATE_JSON = "state.json"
POLICY_FILE = "policy.safetensors"
REFERENCE_FILE = "reference.safetensors"
STATE_FILE = "state.safetensors"
