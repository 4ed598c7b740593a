"""`grouped_ep.hf`: the older name of `grouped_ep.integrations.hf` (the same module object)."""

import sys

from grouped_ep.integrations import hf

sys.modules[__name__] = hf
