"""``python -m grpo.metrics > docs/metrics.md``: the metrics glossary, generated from `grpo.metrics`."""

import sys

from grpo.metrics import glossary_markdown

sys.stdout.write(glossary_markdown())
