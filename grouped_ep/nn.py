"""`grouped_ep.nn`: the older name of `grouped_ep.moe` (the same module object)."""

import sys

from grouped_ep import moe

sys.modules[__name__] = moe
