"""Pulumi entry point (thin). The fleet program lands with the Pulumi issue (#5).

Until then `pulumi preview` stops with a clear message instead of declaring anything.
"""

import pulumi

raise pulumi.RunError(
    "coral: the Pulumi fleet program is not built yet (issue #5). "
    "Use `coral catalog show` and `coral profile table` meanwhile."
)
