"""Old name of `coral bench explain` (its logic: solver/evaluation/paper_explain.py): the
measurements behind the differences between the paper's ratios and ours.
Arguments pass through."""

import sys

from coral_iac.cli.app import app

if __name__ == "__main__":
    app(["bench", "explain", *sys.argv[1:]], prog_name="coral")
